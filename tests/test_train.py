"""The training loop: schedule, metrics, JSONL log, the GPT-2 entry point, bad configs."""

import dataclasses
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch

from geomuon.cli import main as cli
from geomuon.optimizers.assign import ATTENTION_ROLES, STRATEGIES, Hyper, Rule, assign
from geomuon.pretrain.data import BATCH_SEEDING, load_data
from geomuon.pretrain.model import GPT, get_config
from geomuon.pretrain.config import TrainConfig
from geomuon.theory.lipschitz import DEFAULT_METHOD
from geomuon.pretrain.train import (DataRefusal, Evaluation, RunFolderClaim, accumulate_gradients, check_same_run,
                                    evaluate, lr_factor, model_config, owners, read_log, train)


FLOAT64_EPS = 2.0**-52  # the spacing of float64 at 1


def tiny(tmp_path, **overrides):
    base = dict(model="cpu-tiny", strategy="adamw", steps=12, batch_size=4, block_size=32, eval_every=6,
                eval_batches=1, warmup_steps=2, adamw_lr=3e-3, log_every=1, out_dir=str(tmp_path / "run"), progress=False,
                print_table=False)
    return TrainConfig(**{**base, **overrides})


def test_warmup_then_cosine():
    cfg = TrainConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1)
    # a few float64 operations each (cos(π/2) is 6e-17, not 0): 4 ε₆₄ relative covers them
    exact = lambda value: pytest.approx(value, rel=4 * FLOAT64_EPS, abs=0)  # noqa: E731
    assert lr_factor(0, cfg) == exact(0.1) and lr_factor(9, cfg) == exact(1.0)
    assert lr_factor(60, cfg) == exact(0.55)  # half way through the cosine
    assert lr_factor(110, cfg) == exact(0.1)
    factors = [lr_factor(s, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))


def test_owners_balance_the_matrix_work():
    params = [torch.empty(64, 64), torch.empty(64, 64), torch.empty(8, 8), torch.empty(64)]
    owner = owners(params, 2)
    assert owner[0] != owner[1]  # the two big matrices on different ranks
    assert owners(params, 1) == [0, 0, 0, 0]


def test_training_logs_every_metric(tmp_path):
    result = train(tiny(tmp_path, model="cpu-lipschitz", strategy="adamw"))
    assert not result.diverged and result.last_step == 12
    assert result.losses[11] < result.losses[0]
    records = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(12))
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 6, 12]
    last = evals[-1]
    for key in ("val_loss", "val_acc", "max_activation", "max_attn_logit", "lipschitz_bound"):
        assert math.isfinite(last[key]), key
    assert set(last["softmax_jacobian"]) == {"h.0.attn", "h.1.attn"}
    assert "h.0.attn.q.weight" in last["sigma_max"] and "h.0.mlp.c_fc.weight" in last["column_spread"]
    assert 0 < last["val_acc"] < 1 and last["lipschitz_bound"] > 0
    # sigma_max is each weight's largest singular value (fp32: 1e-6 relative), not a
    # power-iteration lower bound (which had logged up to 3.6 % low on trained q/k)
    weights = dict(result.model.named_parameters())
    for name, logged in last["sigma_max"].items():
        exact = torch.linalg.matrix_norm(weights[name].detach().double(), ord=2).item()
        assert logged == pytest.approx(exact, rel=1e-6), name


def test_the_logged_lipschitz_bound_is_the_method_asked_for(tmp_path):
    from geomuon.theory.lipschitz import transformer_lipschitz_bound

    bounds = {}
    for method in ("simple", "joint", "off"):
        result = train(tiny(tmp_path / method, model="cpu-lipschitz", steps=2, eval_every=2, warmup_steps=1,
                                  lipschitz_bound=method))
        bounds[method] = result.evals[-1].get("lipschitz_bound")
        weights = result.model.lipschitz_weights()
        if method != "off":
            assert bounds[method] == transformer_lipschitz_bound(weights, method=method).bound
            assert result.evals[-1]["lipschitz_method"] == method  # the log says which bound it holds
    assert bounds["off"] is None and "lipschitz_method" not in result.evals[-1]  # not computed
    assert bounds["joint"] < bounds["simple"]  # a different bound of the same (seeded) model


def test_bad_configs_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"--strategy 'stiefel' is unknown.*all_stiefel"):
        train(tiny(tmp_path, strategy="stiefel"))
    with pytest.raises(ValueError, match=r"--config 'gpt3' is unknown"):
        train(tiny(tmp_path, model="gpt3"))
    with pytest.raises(ValueError, match=r"--warmup-steps must be in \[0, steps=12\)"):
        train(tiny(tmp_path, warmup_steps=12))
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 30)
    with pytest.raises(ValueError, match=r"short\.txt.*fewer than block_size \+ 1 = 33.*--block-size"):
        train(tiny(tmp_path, data=f"text:{short}"))
    assert not (tmp_path / "run").exists()  # nothing was written: it failed before training


def test_cli_reports_bad_config_and_runs(tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert cli(["pretrain", "--config", "cpu-tiny", "--strategy", "nope", "--out-dir", out]) == 2
    assert "--strategy 'nope' is unknown" in capsys.readouterr().err
    code = cli(["pretrain", "--config", "cpu-tiny", "--strategy", "adamw", "--steps", "4", "--batch-size", "2",
                "--block-size", "16", "--eval-every", "4", "--eval-batches", "1", "--warmup-steps", "1",
                "--out-dir", out, "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and "done: 4 steps" in printed and "parameter" in printed  # the assignment table
    assert os.path.isfile(os.path.join(out, "ckpt.pt"))


def test_build_assignment_hook_builds_the_optimizers_in_memory(tmp_path, monkeypatch):
    """A mapping strategy through the hook: it gets the Hyper made of the config, its
    assignment is the one trained (Stiefel attention keeps σ_max = 1; AdamW attention,
    the control, does not), and ``out_dir=None`` writes nothing."""
    monkeypatch.chdir(tmp_path)
    seen = []

    def stiefel_attention(model, hyper):
        seen.append(hyper)
        return assign(model, {role: Rule("manifold_muon", "stiefel") for role in ATTENTION_ROLES}, hyper)

    cfg = tiny(tmp_path, strategy="my stiefel attention", out_dir=None, lr=0.03, w_max=3.0)
    result = train(cfg, build_assignment=stiefel_attention)
    assert [(h.lr, h.adamw_lr, h.w_max) for h in seen] == [(0.03, 3e-3, 3.0)]
    assert result.assignment.strategy == "custom (attention manifold_muon[stiefel])"
    assert result.last_step == 12 and not result.diverged
    sigma = result.evals[-1]["sigma_max"]["h.0.attn.c_attn.weight"]
    assert sigma == pytest.approx(1.0, abs=1e-4)  # fp32 retraction, 30 power steps on σ = 1 exactly
    control = train(tiny(tmp_path, strategy="adamw", out_dir=None))
    assert control.evals[-1]["sigma_max"]["h.0.attn.c_attn.weight"] != pytest.approx(1.0, abs=1e-2)
    assert list(tmp_path.iterdir()) == []  # no run directory, log or checkpoint
    with pytest.raises(TypeError, match="build_assignment returned a dict"):
        train(cfg, build_assignment=lambda model, hyper: {})


def test_a_rate_the_soft_cap_cannot_hold_is_refused_before_training(tmp_path):
    # soft_cap_alpha raises for a rate past what the cap can bring back to w_max; it had run at each
    # step's scheduled rate, so the warmup reached it mid-run (no checkpoint, a message about eta)
    lipschitz = dict(model="cpu-lipschitz", strategy="lipschitz", warmup_steps=20, steps=40, lipschitz_bound="off")
    refused = r"--lr 1 \(lr=1\) is too large for the soft cap of Muon's group .*w_max=2 .*use --lr \(lr\) ≤ "
    with pytest.raises(ValueError, match=refused) as refusal:
        train(tiny(tmp_path, lr=1.0, **lipschitz))
    assert not (tmp_path / "run").exists()  # before the folder, the log and the first step
    usable = float(re.search(r"--lr \(lr\) ≤ ([\d.e+-]+)", str(refusal.value)).group(1))
    # the largest usable rate, rounded down to 3 digits: it trains at its peak from the first step
    # (no warmup), and 2 % above it (past the rounding, at most 1 % of a 3-digit number) is refused
    result = train(tiny(tmp_path, lr=usable, out_dir=None, stop_after=2, **{**lipschitz, "warmup_steps": 0}))
    assert result.last_step == 2 and not result.diverged
    with pytest.raises(ValueError, match="is too large for the soft cap"):
        train(tiny(tmp_path, lr=usable * 1.02, out_dir=None, **lipschitz))
    with pytest.raises(ValueError, match=r"--lr 1 \(lr=1\) is too large for the soft cap .*w_max=4 "):
        train(tiny(tmp_path, lr=1.0, w_max=4.0, **lipschitz))  # the cap named is the configured one


def test_the_peak_rate_check_asks_the_optimizers_own_update_bound(tmp_path):
    # A hook's Muon with adjust_lr_fn="match_rms_adamw" takes a 13 % larger step at cpu-tiny's
    # attention shapes than Keller's "original" (eta 1.43 lr against 1.26 lr): at w_max = 2 the
    # soft cap holds lr <= 0.43 against 0.49. The check before training had used the default eta,
    # passed lr = 0.45, and the step then refused it mid-run.
    def hook(model, hyper):
        rules = {role: Rule("muon", regulate="soft_cap") for role in ATTENTION_ROLES}
        return assign(model, rules, dataclasses.replace(hyper, extra={"adjust_lr_fn": "match_rms_adamw"}))

    with pytest.raises(ValueError, match=r"--lr 0.45 \(lr=0.45\) is too large for the soft cap "
                                         r".*use --lr \(lr\) ≤ 0\.4"):
        train(tiny(tmp_path, strategy="capped", lr=0.45), build_assignment=hook)
    assert not (tmp_path / "run").exists()
    # control: a rate the cap holds trains
    assert train(tiny(tmp_path, strategy="capped", lr=0.4, out_dir=None, stop_after=2), build_assignment=hook).last_step == 2


def test_a_run_started_with_an_option_its_strategy_ignores_still_resumes(tmp_path):
    # such runs predate the refusal: their checkpoints record the option, which a resume must repeat
    started = tiny(tmp_path, lr=0.05)
    with pytest.raises(ValueError, match="--lr 0.05 would be ignored"):
        started.validate()
    dataclasses.replace(started, resume=True).validate()


def test_evaluation_metrics_show_a_nan_instead_of_hiding_it():
    # Python's max keeps whichever of a NaN and a number comes first: the eval record had shown
    # the max attention logit of a NaN layer as -inf and the max activation as the finite block's
    data = load_data("embedded")
    torch.manual_seed(0)
    model = GPT(get_config("cpu-tiny", vocab_size=data.vocab_size))
    with torch.no_grad():
        model.h[1].attn.c_attn.weight[0, 0] = math.nan  # the second block's attention, and output, go NaN
    metrics = evaluate(model, Evaluation(0, data, 1, 2, 64, 0, torch.device("cpu"), "off"))
    assert math.isfinite(metrics["activation"]["h.0"]) and math.isfinite(metrics["attn_logit"]["h.0.attn"])
    assert math.isnan(metrics["activation"]["h.1"]) and math.isnan(metrics["attn_logit"]["h.1.attn"])
    assert math.isnan(metrics["max_activation"]) and math.isnan(metrics["max_attn_logit"])


def test_the_log_is_strict_json_lines_and_reads_back_non_finite_values(tmp_path):
    # json.dumps wrote bare NaN and -Infinity, which jq and JSON.parse refuse
    from geomuon.pretrain.train import read_log

    odd = {"nan": math.nan, "inf": math.inf, "nested": {"low": -math.inf, "list": [1.0, math.nan]}}
    result = train(tiny(tmp_path, steps=2, warmup_steps=1, eval_every=2), extra_metrics=lambda model, evaluation: odd)

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = open(tmp_path / "run" / "log.jsonl").read().splitlines()
    strict = [json.loads(line, parse_constant=refuse) for line in lines]
    assert strict[0]["nan"] == "NaN" and strict[0]["nested"] == {"low": "-Infinity", "list": [1.0, "NaN"]}
    records = read_log(tmp_path / "run" / "log.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 2 and all(r["step"] == e["step"] for r, e in zip(evals, result.evals))
    for record in evals:
        assert math.isnan(record["nan"]) and record["inf"] == math.inf and record["nested"]["low"] == -math.inf
        assert record["nested"]["list"][0] == 1.0 and math.isnan(record["nested"]["list"][1])
        assert record["val_loss"] == result.evals[evals.index(record)]["val_loss"]  # finite values as they were


def test_extra_metrics_hook_sees_the_evaluated_windows(tmp_path):
    """The hook runs at every evaluation on the windows ``evaluate`` scores: its own loss on
    ``evaluation.windows()`` equals the recorded val loss; ``val_seed`` picks the windows
    and ``final_eval_batches`` enlarges the last evaluation."""
    data = load_data("embedded")
    calls = []

    def own_loss(model, evaluation):
        # the forward evaluate runs: its attention observed (explicit softmax), not the fused
        # kernel, which rounds otherwise (1 ulp of the loss at some windows)
        with model.observe():
            losses = [model(x, y)[1].item() for x, y in evaluation.windows()]
        calls.append((evaluation.step, evaluation.batches, evaluation.seed))
        return {"own_val_loss": sum(losses) / len(losses)}

    cfg = tiny(tmp_path, out_dir=None, val_seed=7, final_eval_batches=3)
    result = train(cfg, data, extra_metrics=own_loss)
    assert calls == [(0, 1, 7), (6, 1, 7), (12, 3, 7)]
    # the same fp32 forward on the same windows gives the same per-batch losses l_b; both sides
    # average them in float64, (Σ l_b)/n here and (Σ l_b·c)/(n·c) in evaluate (c tokens a batch):
    # at most 2n + 2 roundings of u₆₄ = 2⁻⁵³ apart, n ≤ 3 batches
    for record in result.evals:
        assert record["own_val_loss"] == pytest.approx(record["val_loss"], rel=(2 * 3 + 2) * 2.0**-53, abs=0)
    # the validation seed decides the windows: the same initial model scores differently
    other = train(tiny(tmp_path, out_dir=None, steps=2, warmup_steps=1, eval_every=2), data)
    assert other.evals[0]["val_loss"] != pytest.approx(result.evals[0]["val_loss"], rel=1e-4)


def test_model_overrides_reach_the_model_and_are_checked(tmp_path):
    result = train(tiny(tmp_path, out_dir=None, steps=2, warmup_steps=1, eval_every=2,
                        model_overrides={"tie_weights": False, "mlp": "swiglu"}))
    assert result.model.config.tie_weights is False and result.model.config.mlp == "swiglu"
    assert "lm_head.weight" in dict(result.model.named_parameters())  # untied: its own matrix
    with pytest.raises(ValueError, match=r"--model-overrides names 'depth', not a GPTConfig field"):
        train(tiny(tmp_path, model_overrides={"depth": 3}))
    with pytest.raises(ValueError, match=r"block_size is set by both --block-size 32 and --model-overrides block_size=16"):
        train(tiny(tmp_path, model_overrides={"block_size": 16}))
    with pytest.raises(ValueError, match=r"--resume needs an --out-dir"):
        train(tiny(tmp_path, out_dir=None, resume=True))
    with pytest.raises(ValueError, match=r"--final-eval-batches must be ≥ 1"):
        train(tiny(tmp_path, final_eval_batches=0))
    # values, before the data is read (a missing file would be reported first otherwise):
    # each had been a traceback, a crash mid-run or silently accepted
    for overrides, message in (({"rope": "yes"}, "rope='yes' must be bool"), ({"mlp_hidden": -5}, "mlp_hidden=-5 must be >= 0"),
                               ({"init_std": "x"}, "init_std='x' must be float"),
                               ({"init_std": -1.0}, "init_std=-1.0 must be a finite number > 0"),
                               ({"moe_aux_weight": "x", "n_experts": 2}, "moe_aux_weight='x' must be float"),
                               ({"vocab_size": 300}, "sets vocab_size=300, which the character-level --data")):
        with pytest.raises(ValueError, match=re.escape(message)):
            train(tiny(tmp_path, data="text:/nonexistent/x.txt", model_overrides=overrides))
    with pytest.raises(ValueError, match=r"--config cpu-lipschitz with --model-overrides .*needs rope=True"):
        train(tiny(tmp_path, model="cpu-lipschitz", data="text:/nonexistent/x.txt", model_overrides={"rope": False}))
    assert not (tmp_path / "run").exists()


def test_cli_reads_model_overrides_as_json(tmp_path, capsys):
    out = str(tmp_path / "cli")
    args = ["pretrain", "--config", "cpu-tiny", "--steps", "2", "--batch-size", "2", "--block-size", "16",
            "--eval-every", "2", "--eval-batches", "1", "--warmup-steps", "1", "--out-dir", out, "--no-progress"]
    assert cli([*args, "--model-overrides", '{"tie_weights": false}']) == 0
    assert "lm_head.weight" in capsys.readouterr().out  # the untied head in the assignment table
    with pytest.raises(SystemExit):
        cli([*args, "--model-overrides", "[1, 2]"])
    assert "--model-overrides" in capsys.readouterr().err


def test_resume_identity_includes_model_overrides(tmp_path):
    cfg = tiny(tmp_path)
    data = load_data(cfg.data)
    saved = {k: v for k, v in vars(cfg).items() if k != "model_overrides"}
    record = {"config": saved, "model_config": vars(model_config(cfg, data)), "batch_seeding": BATCH_SEEDING}
    check_same_run(record, cfg, data)  # a checkpoint from before the field: its default, the same run
    # a run with an override: compared by the model it builds (the override named as what it changed)
    swiglu = vars(model_config(dataclasses.replace(cfg, model_overrides={"mlp": "swiglu"}), data))
    with pytest.raises(ValueError, match=r"--resume with a different run configuration \(mlp: 'swiglu' → "):
        check_same_run({**record, "config": {**saved, "model_overrides": {"mlp": "swiglu"}}, "model_config": swiglu},
                       cfg, data)


def test_a_checkpoint_of_another_batch_seeding_is_not_resumed(tmp_path):
    # a run checkpointed before the hashed seeding drew its batches by the linear one: resumed
    # under the new one it would have trained on other batches without a word
    out = str(tmp_path / "run")
    assert cli([*PRETRAIN, "--out-dir", out, "--stop-after", "2"]) == 0
    path = os.path.join(out, "ckpt.pt")
    payload = torch.load(path, weights_only=False)
    assert payload["batch_seeding"] == BATCH_SEEDING  # what every checkpoint records now
    cfg = TrainConfig(**{**payload["config"], "resume": True})  # the run as the CLI started it
    data = load_data(cfg.data)
    check_same_run(payload, cfg, data)  # control: the checkpoint as written resumes
    older = {k: v for k, v in payload.items() if k != "batch_seeding"}
    with pytest.raises(ValueError, match=r"by the 'linear' seeding, which this geomuon version replaced by "
                                         r"'blake2b-64'.*resume with the geomuon version that wrote it"):
        check_same_run(older, cfg, data)


@pytest.fixture(scope="module")
def gpt2_small():
    torch.manual_seed(0)
    model = GPT(get_config("gpt2-small"))
    # Start the hidden matrices semi-orthogonal once (on Stiefel and DGram alike), so each
    # manifold strategy below keeps them instead of paying 48 QR factorisations again.
    assign(model, "all_stiefel")
    return model, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow  # 124M parameters: the optimizer step alone is ~10^12 flops per strategy
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_gpt2_small_one_step_per_strategy(gpt2_small, strategy):
    # The GPU entry point's model on CPU: batch 1, 8 tokens, one forward/backward/step;
    # dual_steps=0 (the projected direction) keeps Manifold Muon to one msign per matrix;
    # bf16 directions (fp32 retractions) as a GPU run would use them.
    model, initial = gpt2_small
    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)
    assignment = assign(model, strategy, Hyper(dual_steps=0, compute_dtype=torch.bfloat16))
    idx = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx, idx)
    loss.backward()
    before = model.h[0].mlp.c_fc.weight.detach().clone()
    assignment.step()
    assert math.isfinite(loss.item())
    assert not torch.equal(model.h[0].mlp.c_fc.weight, before)
    assert torch.isfinite(model.h[0].mlp.c_fc.weight).all()


# ----------------------------------------------------------------------------- options


PRETRAIN = ["pretrain", "--config", "cpu-tiny", "--strategy", "adamw", "--steps", "4", "--batch-size", "2",
            "--block-size", "16", "--eval-every", "4", "--eval-batches", "1", "--warmup-steps", "1", "--no-progress",
            "--no-print-table"]


@pytest.mark.parametrize("option, value, message", [
    ("--grad-clip", "-1", "--grad-clip must be ≥ 0"),  # was: gradient ascent, exit 0
    ("--out-dir", "", "--out-dir '' names no folder"),  # had failed only when the run claimed its folder
    ("--eval-every", "0", "--eval-every must be ≥ 1"),  # was: ZeroDivisionError after training started
    ("--weight-decay", "-5", r"--weight-decay must be in \[0, 1e\+06\] \(got -5.0\)"),
    ("--ckpt-every", "-1", "--ckpt-every must be ≥ 0"),
    ("--w-max", "-1", "--w-max must be > 0"),
    ("--lr", "inf", "--lr must be a finite number > 0"),  # was: one step, then divergence
    ("--lr", "nan", "--lr must be a finite number > 0"),
    ("--lr", "-1", "--lr must be > 0"),
    ("--adamw-lr", "0", "--adamw-lr must be > 0"),
    # rates past float32 had passed, then crashed mid-run converting lr·scale to an fp32 scalar
    ("--lr", "3e38", r"--lr must be > 0 and ≤ 1e\+06 \(got 3e\+38\)"),
    ("--adamw-lr", "1e38", r"--adamw-lr must be > 0 and ≤ 1e\+06"),
    ("--weight-decay", "1e38", r"--weight-decay must be in \[0, 1e\+06\] \(got 1e\+38\)"),
    ("--grad-accum", "0", "--grad-accum must be ≥ 1"),
    ("--log-every", "0", "--log-every must be ≥ 1"),
    ("--min-lr-ratio", "1.5", r"--min-lr-ratio must be in \[0, 1\]"),
    ("--stop-after", "0", "--stop-after must be ≥ 1"),
    ("--parallel", "mpi", "--parallel 'mpi' is unknown; choose one of: none, ddp, fsdp"),
    ("--direction-dtype", "fp16", "--direction-dtype 'fp16' is unknown"),
    ("--data", "webtext", "--data: unknown data spec 'webtext'; use one of: embedded, shakespeare:PATH"),
    ("--config", "gpt3", "--config 'gpt3' is unknown; choose one of: .*cpu-tiny"),
    # outside torchrun these had run one ordinary process
    ("--parallel", "ddp", "--parallel ddp runs under torchrun"),
    ("--parallel", "fsdp", "--parallel fsdp runs under torchrun"),
])
def test_every_bad_option_is_refused_before_training(tmp_path, capsys, option, value, message, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    assert cli([*PRETRAIN, "--out-dir", str(out), option, value]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()  # refused before the folder, the data and the first step


@pytest.mark.parametrize("strategy, option, value", [
    ("adamw", "--lr", "0.05"),  # had trained every matrix at --adamw-lr without a word
    ("adamw", "--direction-dtype", "bf16"),
    ("unconstrained", "--dual-steps", "3"),  # Muon has no dual
    ("all_dgram", "--w-max", "0.5"),  # had been described as capping DGram's columns
])
def test_an_option_no_rule_of_the_strategy_takes_is_refused(tmp_path, capsys, strategy, option, value):
    out = tmp_path / "run"
    argv = PRETRAIN + ["--strategy", strategy, option, value, "--out-dir", str(out)]
    assert cli(argv) == 2
    assert f"{option} {value} would be ignored" in capsys.readouterr().err
    assert not out.exists()
    # the default value, and a strategy whose rules take the option, are accepted
    assert TrainConfig(strategy=strategy).unused_options([strategy]) == []
    taker = {"--lr": "unconstrained", "--direction-dtype": "unconstrained", "--dual-steps": "all_dgram",
             "--w-max": "lipschitz"}[option]
    field = option[2:].replace("-", "_")
    kind = type(getattr(TrainConfig(), field) or 0)
    assert TrainConfig(strategy=taker, **{field: kind(value)}).unused_options([taker]) == []


def test_a_lipschitz_bound_asked_of_a_model_without_the_architecture_is_refused(tmp_path, capsys):
    # --lipschitz-bound tight on --config cpu-tiny (no Lipschitz architecture: no bound is logged)
    # had trained with the option ignored
    out = tmp_path / "run"
    assert cli([*PRETRAIN, "--out-dir", str(out), "--lipschitz-bound", "tight"]) == 2
    assert "--lipschitz-bound tight would be ignored: --config cpu-tiny is not a Lipschitz model" in capsys.readouterr().err
    assert not out.exists()
    # controls: the same option on a Lipschitz configuration, "off" and the default on any model,
    # and a resume (which repeats the run's options) are accepted
    assert TrainConfig(model="cpu-lipschitz", lipschitz_bound="tight")._unused_lipschitz_bound(
        get_config("cpu-lipschitz")) == []
    for value in ("off", DEFAULT_METHOD):
        assert TrainConfig(model="cpu-tiny", lipschitz_bound=value)._unused_lipschitz_bound(get_config("cpu-tiny")) == []
    assert TrainConfig(model="cpu-tiny", lipschitz_bound="tight", resume=True)._unused_lipschitz_bound(
        get_config("cpu-tiny")) == []


def test_a_resume_told_to_stop_before_its_checkpoint_is_refused(tmp_path, capsys):
    # --resume --stop-after 2 on a run checkpointed at step 3 had exited 0 with "done: 3 steps"
    # and trained nothing. Control: stopping at a later step resumes.
    out = str(tmp_path / "run")
    assert cli([*PRETRAIN, "--out-dir", out, "--stop-after", "3"]) == 0
    capsys.readouterr()
    assert cli([*PRETRAIN, "--out-dir", out, "--resume", "--stop-after", "2"]) == 2
    assert "--stop-after 2 is before the checkpoint's step 3" in capsys.readouterr().err
    assert cli([*PRETRAIN, "--out-dir", out, "--resume", "--stop-after", "4"]) == 0


def test_a_run_stopped_early_prints_the_command_that_continues_it_to_its_end(tmp_path, capsys):
    # after --stop-after it said "done: 2 steps" and nothing of the rest (geomuon compare prints the
    # command); the command printed continues to --steps. Control: a finished run prints none
    out = str(tmp_path / "run")
    assert cli([*PRETRAIN, "--out-dir", out, "--stop-after", "2"]) == 0
    said = re.search(r"^continue the run to step 4 with: geomuon (pretrain .*)$", capsys.readouterr().out, re.M)
    assert said and "--stop-after" not in said.group(1) and "--resume" in said.group(1), said
    assert cli(shlex.split(said.group(1))) == 0
    finished = capsys.readouterr().out
    assert "done: 4 steps" in finished and "continue the run" not in finished, finished


@pytest.mark.parametrize("options, environment, named", [
    (dict(data="webtext"), {}, ["--data", "'webtext'"]),
    (dict(model_overrides={"depth": 3}), {}, ["--model-overrides", "'depth'"]),
    (dict(model_overrides={"n_layer": 3}, n_layer=2), {}, ["--n-layer 2", "--model-overrides n_layer=3"]),
    (dict(model_overrides={"vocab_size": 300}), {}, ["--model-overrides", "vocab_size=300"]),
    (dict(model_overrides={"n_head": 3}), {}, ["--model-overrides", '"n_head": 3']),
    (dict(lipschitz_bound="simple"), {}, ["--lipschitz-bound simple"]),
    (dict(lr=0.05), {}, ["--lr 0.05"]),
    (dict(strategy="torch_muon", direction_dtype="fp32"), {}, ["--direction-dtype fp32", "--strategy torch_muon"]),
    (dict(out_dir=""), {}, ["--out-dir", "''"]),
    (dict(out_dir=None, resume=True), {}, ["--resume", "out_dir=None"]),
    (dict(out_dir=None, overwrite=True), {}, ["--overwrite", "out_dir=None"]),
    (dict(resume=True, overwrite=True), {}, ["--resume", "--overwrite", "both given"]),
    (dict(resume=True, out_dir="runs/{time}"), {}, ["--resume", "--out-dir", "'runs/{time}'"]),
    (dict(warmup_steps=12), {}, ["--warmup-steps", "(got 12)", "steps=12"]),
    (dict(stop_after=13), {}, ["--stop-after", "(got 13)", "steps=12"]),
    (dict(device="cuda"), {}, ["--device cuda"]),
    ({}, dict(WORLD_SIZE="two"), ["WORLD_SIZE", "'two'"]),
    ({}, dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"), ["--parallel none", "2 processes (WORLD_SIZE)"]),
    (dict(parallel="ddp"), {}, ["--parallel ddp", "MASTER_ADDR is unset"]),
    (dict(parallel="fsdp"), dict(MASTER_ADDR="127.0.0.1", FIND_SPEC="none"), ["--parallel fsdp"]),
    (dict(parallel="ddp", batch_size=3), dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"),
     ["--batch-size 3", "2 processes"]),
])
def test_every_refusal_of_validate_names_its_option_the_value_and_what_to_do(tmp_path, monkeypatch, options,
                                                                              environment, named):
    """Each relation :meth:`TrainConfig.validate` checks beyond the option table (which
    ``test_the_option_table_refuses_a_value_just_outside_each_bound`` probes), one case each: the
    refusal names the option as the command line spells it and the value given, and says what to
    do (a clause after ';'); some had named a flag alone ("--resume/--overwrite need an --out-dir")."""
    from geomuon.pretrain import config as config_module

    for name in ("WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        if name == "FIND_SPEC":  # a geomuon without its parallel module
            monkeypatch.setattr(config_module.importlib.util, "find_spec", lambda module: None)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device cuda on a machine without CUDA
    with pytest.raises(ValueError) as refused:
        tiny(tmp_path, **options).validate()
    problems = str(refused.value).removeprefix("bad training config:\n  ").split("\n  ")
    assert len(problems) == 1, problems  # the case's own refusal, alone
    for text in named:
        assert text in problems[0], (text, problems[0])
    assert "; " in problems[0], problems[0]


def test_the_option_table_refuses_a_value_just_outside_each_bound():
    """Every numeric option declared with a bound refuses the nearest value outside it,
    with a message naming its flag: the table, not a hand-written list, does the checking."""
    from dataclasses import fields, replace

    checked = 0
    for f in fields(TrainConfig):
        opt = f.metadata["option"]
        flag = opt.flag or "--" + f.name.replace("_", "-")
        for outside in ([opt.at_least - 1] if opt.at_least is not None else []) + (
                [opt.above] if opt.above is not None else []) + ([opt.at_most + 1] if opt.at_most is not None else []):
            cfg = replace(TrainConfig(), **{f.name: type(f.default or 1)(outside)})
            with pytest.raises(ValueError, match=re.escape(flag)):
                cfg.validate()
            checked += 1
    assert checked >= 20  # every bounded option of the table was probed


import re  # noqa: E402


def test_help_lists_the_valid_values(capsys):
    with pytest.raises(SystemExit):
        cli(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("one of: cpu-lipschitz, cpu-moe", "all_stiefel, hetero", "shakespeare:PATH[:nocheck]",
                     "tokens:DIR", "[optimizer steps]", "--parallel", "none, ddp, fsdp", "--grad-accum",
                     "default: runs/{strategy}-{time}", "--overwrite",
                     # what the option also sets (the lipschitz strategy's cap, the unconstrained Muon decay)
                     "the RMS→RMS spectral cap of the regulated matrices (the lipschitz strategy's soft cap)",
                     "decoupled weight decay of AdamW and of the unregulated Muon matrices",
                     "learning rate of the matrix optimizers; > 0 and ≤ 1e+06"):
        assert expected in text, expected
    with pytest.raises(SystemExit):
        cli(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: runs/compare-{time}" in text and "--strategies" in text and "[nats]" in text
    for dropped in ("--strategy ", "--seed "):  # each run's: set by --strategies and --seeds
        assert dropped not in text


# ----------------------------------------------------------------------------- run folders


def test_a_second_run_never_overwrites_the_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli(PRETRAIN) == 0 and cli(PRETRAIN) == 0  # the default folder: fresh each time
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2 and all((f / "ckpt.pt").is_file() for f in folders)
    assert all(f.name.startswith("adamw-") for f in folders)
    named = str(tmp_path / "mine")
    assert cli([*PRETRAIN, "--out-dir", named]) == 0
    before = {name: open(os.path.join(named, name), "rb").read() for name in os.listdir(named)}
    capsys.readouterr()
    assert cli([*PRETRAIN, "--out-dir", named, "--steps", "8"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert {name: open(os.path.join(named, name), "rb").read() for name in os.listdir(named)} == before
    assert cli([*PRETRAIN, "--out-dir", named, "--steps", "8", "--overwrite"]) == 0
    assert torch.load(os.path.join(named, "ckpt.pt"), weights_only=False)["step"] == 8
    prev = torch.load(os.path.join(named, "ckpt.prev.pt"), weights_only=False)
    assert prev["config"]["steps"] == 8  # the new run's (step 4), not the replaced run's


def test_a_folder_in_use_by_a_running_run_is_refused(tmp_path, monkeypatch, capsys):
    # Two runs started at once into one folder had both passed the checks (no run files yet)
    # and then written into each other's checkpoints. A run holds a lock on its folder.
    named = str(tmp_path / "busy")
    running = RunFolderClaim(named)  # what a run holds while it trains (another process's lock alike)
    assert cli([*PRETRAIN, "--out-dir", named]) == 2
    assert "is in use by another run" in capsys.readouterr().err
    assert os.listdir(named) == [".lock"]  # nothing was written
    running.release()
    assert not os.path.exists(named)  # the claim created it and no run wrote to it
    assert cli([*PRETRAIN, "--out-dir", named]) == 0  # control: free again
    # a templated name taken at the same second by a running run gets the next suffix
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt, t=None: "20261205-120000")
    first = RunFolderClaim(os.path.join("runs", "adamw-20261205-120000"))
    assert cli(PRETRAIN) == 0
    assert sorted(os.listdir("runs")) == ["adamw-20261205-120000", "adamw-20261205-120000-2"]
    first.release()


def _claim_unless_in_use(folder: str) -> RunFolderClaim | None:
    """A rival run's claim on ``folder``: the claim, or ``None`` when refused as in use."""
    try:
        return RunFolderClaim(folder)
    except ValueError as err:
        assert "is in use by another run" in str(err)
        return None


def _holds_the_folder(claim: RunFolderClaim) -> bool:
    """The claim's lock is on the file at ``<folder>/.lock`` (a lock on a removed file excludes no one)."""
    return os.path.samestat(os.fstat(claim.file.fileno()), os.stat(os.path.join(claim.path, ".lock")))


def test_a_released_folder_is_never_held_by_two_runs(tmp_path, monkeypatch):
    # release unlocked first and then removed .lock and the folder: a run that locked .lock in
    # between lost it, and the next run locked a new .lock in the same folder, both "holding" it.
    # A rival claims right before each step of release, and once after it: one of them holds it.
    folder = str(tmp_path / "run")
    releasing, rivals = RunFolderClaim(folder), []
    for name in ("listdir", "remove", "rmdir"):
        def claim_then(*args, step=getattr(os, name)):
            rivals.append(_claim_unless_in_use(folder))
            return step(*args)
        monkeypatch.setattr(os, name, claim_then)
    releasing.release()
    monkeypatch.undo()
    assert len(rivals) == 3  # each step ran (the folder was empty but for .lock)
    rivals.append(_claim_unless_in_use(folder))
    held = [claim for claim in rivals if claim is not None]
    assert len(held) == 1 and _holds_the_folder(held[0]), rivals
    held[0].release()


def test_a_claim_on_a_lock_file_released_meanwhile_claims_again(tmp_path, monkeypatch):
    # a rival that opened .lock before the holder released (and removed) it, and locked it after,
    # had held a removed file, so a third run locked a new .lock beside it
    import fcntl

    folder = str(tmp_path / "run")
    releasing, lock = RunFolderClaim(folder), fcntl.flock

    def release_then_lock(file, operation):
        monkeypatch.setattr(fcntl, "flock", lock)
        releasing.release()
        return lock(file, operation)

    monkeypatch.setattr(fcntl, "flock", release_then_lock)
    rival = RunFolderClaim(folder)
    assert fcntl.flock is lock  # the release ran between the rival's open and its lock
    assert _holds_the_folder(rival) and _claim_unless_in_use(folder) is None
    rival.release()
    assert not os.path.exists(folder)


def test_an_overwrite_of_a_template_is_refused_not_ignored(tmp_path, monkeypatch, capsys):
    # the template had named a fresh folder ('tpl-adamw-2'), the run meant to be replaced staying
    monkeypatch.chdir(tmp_path)
    assert cli([*PRETRAIN, "--out-dir", "tpl-{strategy}", "--stop-after", "1"]) == 0
    capsys.readouterr()
    assert cli([*PRETRAIN, "--out-dir", "tpl-{strategy}", "--overwrite"]) == 2
    assert ("--overwrite would be ignored: --out-dir 'tpl-{strategy}' is a template, which names a fresh folder "
            "for every run; give the folder of the run to replace") in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["tpl-adamw"]  # no second folder
    assert cli([*PRETRAIN, "--out-dir", "tpl-adamw", "--overwrite"]) == 0  # control: the folder itself


@pytest.mark.parametrize("out_dir, message", [("x/{seed}", "not a folder template"), ("x/run{}", "not a folder template"),
                                              ("x/a{b", "not a folder template"), ("afile", "is a file, not a folder"),
                                              ("afile/run", "cannot be created"),
                                              ("dangling/run", "cannot be created (No such file or directory)")])
def test_bad_out_dirs_are_refused_by_name(tmp_path, monkeypatch, capsys, out_dir, message):
    monkeypatch.chdir(tmp_path)
    open("afile", "w").close()
    os.symlink("unmounted/runs", "dangling")  # a link to a folder that is not there
    # each had been a raw KeyError/IndexError/OSError traceback, the last ones after the data loaded;
    # the dangling link had hung the run, silently (its claim taken for a race and retried forever)
    assert cli([*PRETRAIN, "--out-dir", out_dir]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"geomuon pretrain: --out-dir (out_dir) {out_dir!r}") and message in err, err


def test_done_line_says_where_its_val_loss_was_measured(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert cli([*PRETRAIN, "--out-dir", out, "--steps", "10", "--eval-every", "4", "--stop-after", "6"]) == 0
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith("done: 6 steps") and "at step 4," in done[0]  # the last evaluation


# ----------------------------------------------------------------------------- batches


def _gradient(model, micro_batches):
    model.zero_grad(set_to_none=True)
    loss = accumulate_gradients(model, micro_batches)
    return loss, torch.cat([p.grad.flatten() for p in model.parameters()])


def test_gradient_accumulation_equals_the_larger_batch():
    """K micro-batches of B windows give the gradient of one K·B batch, in fp32, up to the
    order of the sums. Each gradient entry sums N = K·B·T per-token terms; recursive fp32
    summation errs by at most ≈ N·u relative (u = 2⁻²⁴, Higham's γ_N) for terms without
    cancellation, so ‖Δg‖/‖g‖ ≤ N·u (N·u ≈ 2.3e-5 here; measured ≈ 2.5e-7). The controls —
    the summed instead of averaged losses, and K copies of the first micro-batch — miss
    by orders of magnitude more."""
    torch.manual_seed(0)
    data = load_data("embedded")
    model = GPT(get_config("cpu-tiny", vocab_size=data.vocab_size, block_size=32))
    K, B, T = 4, 3, 32
    x, y = data.batch("train", K * B, T, 0, 0)
    micro = [(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]) for k in range(K)]
    loss_big, g_big = _gradient(model, [(x, y)])
    loss_acc, g_acc = _gradient(model, micro)
    tol = K * B * T * 2.0**-24
    assert float((g_acc - g_big).norm() / g_big.norm()) <= tol
    assert abs(float(loss_acc - loss_big)) <= tol * float(loss_big)
    model.zero_grad(set_to_none=True)
    for batch in micro:  # control: losses summed, not averaged (no 1/K)
        accumulate_gradients(model, [batch])
    g_sum = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float((g_sum - g_big).norm() / g_big.norm()) > 1000 * tol
    _, g_same = _gradient(model, [micro[0]] * K)  # control: the wrong windows
    assert float((g_same - g_big).norm() / g_big.norm()) > 1000 * tol


def test_grad_accum_trains_on_the_windows_of_the_larger_batch(tmp_path):
    """The first logged loss of ``--grad-accum 2 --batch-size 2`` is the loss of
    ``--batch-size 4`` on the same windows (N = 4·32 summed token losses: tolerance N·u,
    see above); without accumulation (batch 2) it differs — the control."""
    data = load_data("embedded")
    run = lambda **kw: train(tiny(tmp_path, out_dir=None, steps=2, warmup_steps=1, eval_every=2, **kw), data)  # noqa: E731
    accumulated, larger, smaller = run(batch_size=2, grad_accum=2), run(batch_size=4), run(batch_size=2)
    tol = 4 * 32 * 2.0**-24
    assert abs(accumulated.losses[0] - larger.losses[0]) <= tol * larger.losses[0]
    assert abs(smaller.losses[0] - larger.losses[0]) > 100 * tol * larger.losses[0]


def test_the_loop_brings_the_loss_to_the_host_only_every_log_every_steps(tmp_path, monkeypatch):
    """The loop itself (not the evaluation, not the optimizers) synchronises with the
    device once per log step, at the evaluations and at the end — never per step; every
    step's loss still reaches the result. The control: with ``log_every=1``, once a step."""
    import sys

    calls = []
    for name in ("item", "tolist", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name):
            caller = sys._getframe(1).f_code
            if caller.co_filename.endswith(os.path.join("pretrain", "train.py")) and caller.co_name in (
                    "_train", "flush", "_global_mean", "accumulate_gradients"):
                calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    result = train(tiny(tmp_path, out_dir=None, steps=20, eval_every=20, log_every=5))
    assert sorted(result.losses) == list(range(20))
    assert calls == ["tolist"] * 5  # after steps 0, 5, 10, 15 and the last (19, before its evaluation)
    calls.clear()
    train(tiny(tmp_path, out_dir=None, steps=20, eval_every=20, log_every=1))
    assert len(calls) == 20


def test_many_processes_need_a_parallel_mode_and_a_divisible_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets them
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=r"2 processes \(WORLD_SIZE\) but --parallel none; choose --parallel ddp"):
        tiny(tmp_path).validate()
    with pytest.raises(ValueError, match=r"--batch-size 3 must be a multiple of the 2 processes"):
        tiny(tmp_path, parallel="ddp", batch_size=3).validate()
    tiny(tmp_path, parallel="ddp").validate()  # the control: a valid torchrun configuration
    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny(tmp_path).validate()


# ----------------------------------------------------------------------------- what a run applies


def _documented_factor(step, steps, warmup, min_ratio):
    r"""The schedule as :func:`lr_factor`'s docstring writes it, computed here on its own:
    $\min(1, (s+1)/w)$ for $s < w$, then $r + (1-r)\tfrac12(1 + \cos(\pi (s-w)/(S-w)))$."""
    if step < warmup:
        return min(1.0, (step + 1) / warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))


@pytest.mark.parametrize("steps, warmup, stop_after", [(1, 0, None), (5, 0, None), (7, 3, 2)])
def test_every_group_applies_the_documented_schedule_through_a_resume_in_the_warmup(
        tmp_path, monkeypatch, steps, warmup, stop_after):
    """The rate each optimizer group holds when it steps is its base rate (``--lr`` for Muon,
    ``--adamw-lr`` for AdamW) times the documented warmup + cosine factor, and the log's
    ``lr_factor`` is that factor — with no warmup, for a single step, and for a run
    stopped inside its warmup and resumed. Both sides evaluate the same formula in float64
    with a handful of roundings each: 16 ε₆₄ relative covers them."""
    from geomuon.optimizers.assign import Assignment

    applied = []
    step_as_built = Assignment.step

    def recording_step(self):
        applied.append([(group["lr"], group["base_lr"]) for group in self.param_groups])
        return step_as_built(self)

    monkeypatch.setattr(Assignment, "step", recording_step)
    cfg = tiny(tmp_path, strategy="unconstrained", steps=steps, warmup_steps=warmup, batch_size=2, block_size=16,
               eval_every=steps, lr=0.03, adamw_lr=0.002, min_lr_ratio=0.2)
    if stop_after is not None:
        train(dataclasses.replace(cfg, stop_after=stop_after))
        cfg = dataclasses.replace(cfg, resume=True)
    train(cfg)
    assert len(applied) == steps  # the resumed session repeats no step and skips none
    logged = [r for r in read_log(str(tmp_path / "run" / "log.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in logged] == list(range(steps))
    for step, (groups, record) in enumerate(zip(applied, logged)):
        expected = _documented_factor(step, steps, warmup, 0.2)
        assert record["lr_factor"] == pytest.approx(expected, rel=16 * FLOAT64_EPS, abs=0)
        assert {base for _, base in groups} == {0.03, 0.002}  # Muon's and AdamW's base rates
        for rate, base in groups:
            assert rate == pytest.approx(base * expected, rel=16 * FLOAT64_EPS, abs=0), (step, base)


def test_the_logged_gradient_norm_is_the_norm_before_clipping_and_the_step_sees_the_clipped_one(
        tmp_path, monkeypatch):
    """``grad_norm`` in the log is the global gradient norm before clipping, recomputed here
    from a freshly seeded model on the step's windows; the optimizers step on gradients
    clipped to ``--grad-clip``; ``--grad-clip 0`` leaves them as they are. The loop averages
    two micro-batches of 3 windows, the recomputation takes the 6 windows at once: the same
    gradient in exact arithmetic, fp32 forwards and backwards of this two-layer model that
    differ by a few u₃₂ = 2⁻²⁴ relative, far inside the P·u₃₂ relative the test allows for the
    norms' sums (P parameters; Higham's bound for a sum of P squares, 1.7e-3 here). The
    control: after clipping to 10⁻³ the norm is about 10³ times smaller."""
    from geomuon.optimizers.assign import Assignment

    data = load_data("embedded")
    seen = []
    step_as_built = Assignment.step

    def recording_step(self):
        seen.append(math.sqrt(sum(float(p.grad.double().square().sum()) for group in self.param_groups
                                  for p in group["params"] if p.grad is not None)))
        return step_as_built(self)

    monkeypatch.setattr(Assignment, "step", recording_step)
    clip = 1e-3
    cfg = tiny(tmp_path, steps=1, warmup_steps=0, eval_every=1, batch_size=3, grad_accum=2, block_size=16,
               grad_clip=clip, seed=5)
    train(cfg, data)
    logged = [r for r in read_log(str(tmp_path / "run" / "log.jsonl")) if r["kind"] == "train"][0]["grad_norm"]
    torch.manual_seed(5)
    model = GPT(model_config(cfg, data))
    x, y = data.batch("train", 6, 16, 5, 0)  # the step's grad_accum × batch_size windows
    model(x, y)[1].backward()
    grads = [p.grad.double() for p in model.parameters()]
    pre_clip = math.sqrt(sum(float(g.square().sum()) for g in grads))
    tolerance = sum(g.numel() for g in grads) * 2.0**-24
    assert logged == pytest.approx(pre_clip, rel=tolerance)
    assert seen[0] == pytest.approx(clip, rel=tolerance)  # the optimizers stepped on the clipped gradient
    assert pre_clip > 100 * clip
    seen.clear()
    train(dataclasses.replace(cfg, grad_clip=0.0, out_dir=None), data)
    assert seen[0] == pytest.approx(pre_clip, rel=tolerance)  # 0: not clipped


def test_validation_loss_is_recomputed_on_the_same_windows_for_every_strategy_and_seed(tmp_path):
    """With ``val_seed`` set, every strategy and seed scores the windows
    ``data.batch("val", batch_size, block_size, val_seed, i)``, i < eval_batches; the logged
    final ``val_loss`` is recomputed here from the returned model as the mean token
    cross-entropy over those windows. N = 2·4·16 token losses, each the same fp32 forward:
    only the order of their sum differs, so they agree to N·u₃₂ relative."""
    data = load_data("embedded")
    windows = [data.batch("val", 4, 16, 9, i) for i in range(2)]
    tolerance = 2 * 4 * 16 * 2.0**-24
    seen = {}

    def record_windows(model, evaluation):
        seen.setdefault((evaluation.step,), []).append([(x.clone(), y.clone()) for x, y in evaluation.windows()])
        return {}

    finals = []
    for strategy, seed in (("adamw", 0), ("hetero", 0), ("adamw", 1)):
        cfg = tiny(tmp_path, out_dir=None, strategy=strategy, seed=seed, steps=3, warmup_steps=0, eval_every=3,
                   eval_batches=2, batch_size=4, block_size=16, val_seed=9)
        result = train(cfg, data, extra_metrics=record_windows)
        with torch.no_grad():
            logits = torch.cat([result.model(x, y)[0] for x, y in windows])
        targets = torch.cat([y for _, y in windows])
        own = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), targets.flatten()).item()
        assert result.evals[-1]["val_loss"] == pytest.approx(own, rel=tolerance), (strategy, seed)
        finals.append(result.evals[-1]["val_loss"])
    for batches in seen.values():
        for scored in batches:
            assert all(torch.equal(a, b) for (a, _), (b, _) in zip(scored, windows))
    assert len(set(finals)) == 3  # the control: the runs themselves differ


def test_the_same_seed_repeats_a_run_bitwise_and_another_seed_does_not(tmp_path):
    data = load_data("embedded")
    cfg = tiny(tmp_path, out_dir=None, strategy="unconstrained", steps=4, warmup_steps=1, eval_every=2,
               batch_size=2, block_size=16, grad_accum=2)
    first, again, other = train(cfg, data), train(cfg, data), train(dataclasses.replace(cfg, seed=1), data)
    assert first.losses == again.losses
    assert [e["val_loss"] for e in first.evals] == [e["val_loss"] for e in again.evals]
    assert all(torch.equal(a, b) for a, b in zip(first.model.state_dict().values(),
                                                   again.model.state_dict().values()))
    assert all(first.losses[s] != other.losses[s] for s in first.losses)


def test_gradient_accumulation_equals_the_larger_batch_in_float64():
    """The float64 model (``GPT(...).double()``) takes ``accumulate_gradients`` to round-off:
    each gradient entry sums N = K·B·T per-token terms, so both sides agree to N·u₆₄
    relative (u₆₄ = 2⁻⁵³, ≈ 1e-14 here) — eight orders of magnitude below the fp32 test's
    bound, so a micro-batch mis-weighted by a float32 factor would show."""
    torch.manual_seed(0)
    data = load_data("embedded")
    model = GPT(get_config("cpu-tiny", vocab_size=data.vocab_size, block_size=16)).double()
    K, B, T = 3, 2, 16
    x, y = data.batch("train", K * B, T, 0, 0)
    micro = [(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]) for k in range(K)]
    loss_big, g_big = _gradient(model, [(x, y)])
    loss_acc, g_acc = _gradient(model, micro)
    assert loss_acc.dtype == torch.float64
    tol = K * B * T * 2.0**-53
    assert float((g_acc - g_big).norm() / g_big.norm()) <= tol
    assert abs(float(loss_acc - loss_big)) <= tol * float(loss_big)
    _, g_first = _gradient(model, micro[:1])  # the control: one micro-batch alone
    assert float((g_first - g_big).norm() / g_big.norm()) > 1e6 * tol


def _odd_shards(folder):
    """A token folder whose train shard ends in half a token (and a valid val shard)."""
    folder.mkdir()
    (folder / "train.bin").write_bytes(b"\x01\x00\x02")
    (folder / "val.bin").write_bytes(b"\x01\x00" * 64)


@pytest.mark.parametrize("spec, make, message, refusal", [
    ("text:{dir}/empty.txt", lambda d: (d / "empty.txt").write_text(""), r"empty\.txt: the text is empty",
     DataRefusal),
    ("text:{dir}/latin1.txt", lambda d: (d / "latin1.txt").write_bytes(b"caf\xe9 " * 200),
     r"latin1\.txt' is not UTF-8", DataRefusal),
    ("text:{dir}/missing.txt", lambda d: None, r"missing\.txt' does not exist", DataRefusal),
    ("text:{dir}/short.txt", lambda d: (d / "short.txt").write_text("abc" * 10),
     r"short\.txt: the (train|val) split has \d+ tokens", ValueError),
    ("tokens:{dir}/shards", lambda d: _odd_shards(d / "shards"), r"train\.bin': 3 bytes is not a whole number",
     DataRefusal),
])
def test_a_bad_data_file_is_refused_by_name_before_anything_is_written(tmp_path, capsys, spec, make, message,
                                                                       refusal):
    make(tmp_path)
    out = tmp_path / "run"
    assert cli([*PRETRAIN, "--out-dir", str(out), "--data", spec.format(dir=tmp_path)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()  # no run folder left behind
    # a DataRefusal: this process's load refused it (under torchrun every rank raising one prints it);
    # a plain ValueError: the data loaded, and its check for the model (its context) is refused alike by
    # every rank, which agreed on their data first (rank 0 prints it)
    with pytest.raises(ValueError, match=message) as refused:
        train(tiny(tmp_path, data=spec.format(dir=tmp_path)))
    assert type(refused.value) is refusal


def test_data_other_than_the_configured_data_is_refused(tmp_path):
    # the checkpoint records cfg.data ("embedded") while the run trained on the text: a resume from the
    # command line was then refused whatever --data said. Control: the configured data is welcome.
    text = tmp_path / "fox.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    with pytest.raises(ValueError, match="is not cfg.data"):
        train(tiny(tmp_path, steps=2, warmup_steps=0), load_data(f"text:{text}"))
    assert not (tmp_path / "run").exists()
    train(tiny(tmp_path, steps=2, warmup_steps=0, eval_every=2, data=f"text:{text}"), load_data(f"text:{text}"))


def test_a_torchrun_process_of_the_command_leaves_without_interpreter_finalization():
    # A two-process gloo run could abort after "done" (SIGABRT, "terminate called without an active
    # exception": the process group's worker thread released the last collective's tensors while
    # the interpreter finalized), failing the torchrun job. Under WORLD_SIZE > 1 the command leaves
    # by os._exit once its output is flushed: no atexit handler runs, the status and the message
    # arrive. Control: one process finalizes as usual.
    script = ("import atexit, sys; atexit.register(lambda: print('finalized', flush=True)); "
              "sys.argv = ['geomuon', 'pretrain', '--lr', '-1']; from geomuon.cli import entry; entry()")
    for world, finalized in (("2", False), ("1", True)):
        env = {**os.environ, "WORLD_SIZE": world}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "--lr must be > 0" in done.stderr, done.stderr
        assert ("finalized" in done.stdout) == finalized


def _token_folder(folder, top: int):
    """nanoGPT shards (headerless uint16) whose largest token id is ``top``."""
    import numpy as np
    folder.mkdir()
    tokens = np.arange(4096, dtype=np.uint16)
    tokens[::97] = top
    tokens.tofile(folder / "train.bin")
    tokens[:512].tofile(folder / "val.bin")
    return folder


def test_token_shards_are_read_against_the_models_vocabulary(tmp_path):
    # A model with GPT-2's 50257-token vocabulary trains on shards whose ids are all below it;
    # shards had always been read as a 50304-token vocabulary, which the model then refused.
    folder = _token_folder(tmp_path / "shards", top=50256)
    cfg = tiny(tmp_path, data=f"tokens:{folder}", steps=1, eval_every=1, warmup_steps=0, out_dir=None,
                model_overrides={"vocab_size": 50257})
    result = train(cfg)
    assert result.last_step == 1 and all(math.isfinite(loss) for loss in result.losses.values()) and result.losses
    assert result.model.config.vocab_size == 50257
    # control: an id the model's vocabulary cannot embed is refused by name, before training
    big = _token_folder(tmp_path / "big", top=50257)
    with pytest.raises(ValueError, match=r"token id 50257 ≥ vocab_size 50257 \(the model's vocabulary\)"):
        train(dataclasses.replace(cfg, data=f"tokens:{big}"))


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("RANK", "-1"), ("LOCAL_RANK", "x")])
def test_a_malformed_launcher_variable_is_refused_by_name(tmp_path, capsys, monkeypatch, name, value):
    # torchrun's variables had been read with a bare int(): "invalid literal for int()", naming nothing
    monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    assert cli([*PRETRAIN, "--out-dir", str(out)]) == 2
    assert f"environment variable {name}={value!r} is not an integer" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- refusals and hooks for Python callers


def test_run_folder_refusals_name_the_python_spelling_of_each_option(tmp_path):
    # train(TrainConfig(...)) had been told "continue it with --resume, replace it with --overwrite":
    # flags a Python caller has no use for (its spelling is resume=True, overwrite=True, out_dir)
    cfg = tiny(tmp_path, steps=2, warmup_steps=1, eval_every=2)
    train(cfg)
    with pytest.raises(ValueError, match=r"^--out-dir \(out_dir\) '.*' already holds a run .*continue it with --resume "
                                         r"\(resume=True\), replace it with --overwrite \(overwrite=True\)"):
        train(cfg)
    other = tiny(tmp_path, steps=2, warmup_steps=1, eval_every=2, out_dir=str(tmp_path / "busy"))
    running = RunFolderClaim(other.out_dir)
    with pytest.raises(ValueError, match=r"^--out-dir \(out_dir\) '.*busy' is in use by another run"):
        train(other)
    running.release()
    # a folder that holds a run which is still running: that it is in use comes first (its "continue
    # it with --resume" had led to the in-use refusal second); control: released, it holds a run
    running = RunFolderClaim(cfg.out_dir)
    with pytest.raises(ValueError, match=r"^--out-dir \(out_dir\) '.*' is in use by another run \(it holds '.lock'\); "
                                         r"wait for it to finish"):
        train(cfg)
    running.release()
    with pytest.raises(ValueError, match=r"already holds a run"):
        train(cfg)


def test_an_out_dir_with_a_literal_brace_names_one_folder_and_resumes(tmp_path, monkeypatch, capsys):
    # x{{b}} names the folder x{b}; it had counted as a template because format() changed it: a
    # second run went to x{b}-2 instead of being refused, and a resume could never find x{b}
    from geomuon.pretrain.train import TrainingInterrupted, resolve_out_dir

    cfg = tiny(tmp_path, steps=2, warmup_steps=1, eval_every=2, out_dir=str(tmp_path / "x{{b}}"))
    folder = str(tmp_path / "x{b}")
    assert train(cfg).out_dir == folder
    with pytest.raises(ValueError, match="already holds a run"):
        train(cfg)
    assert sorted(os.listdir(tmp_path)) == ["x{b}"]
    assert resolve_out_dir(dataclasses.replace(cfg, resume=True)) == folder
    # and the resume itself (the config's check had refused any brace as "the template")
    assert train(dataclasses.replace(cfg, steps=2, resume=True)).out_dir == folder
    # the resume command an interrupted run prints names that folder, braces doubled
    def interrupted(cfg, *args, **kwargs):
        raise TrainingInterrupted(1, signal.SIGINT, folder)

    monkeypatch.setattr("geomuon.pretrain.train.train", interrupted)
    assert cli([*PRETRAIN, "--out-dir", cfg.out_dir]) == 128 + signal.SIGINT
    command = shlex.split(capsys.readouterr().err.split("resume with: ")[1])
    printed = command[command.index("--out-dir") + 1]
    assert printed == cfg.out_dir and resolve_out_dir(dataclasses.replace(cfg, out_dir=printed, resume=True)) == folder


def test_extra_metrics_that_rename_a_metric_or_cannot_be_logged_are_refused_by_name(tmp_path):
    # {"val_loss": 0.0} had replaced the measured val loss (the divergence verdict and compare's
    # table then read the hook's number), and a tensor had stopped a run on disk with json's
    # "Object of type Tensor is not JSON serializable", naming no hook (in memory it passed)
    cfg = tiny(tmp_path, steps=2, warmup_steps=1, eval_every=2, out_dir=None)
    with pytest.raises(ValueError, match=r"extra_metrics returned 'val_loss', which the evaluation measures itself"):
        train(cfg, extra_metrics=lambda model, evaluation: {"val_loss": 0.0})
    with pytest.raises(ValueError, match=r"extra_metrics returned 'head_norm' = Tensor, which the log cannot write"):
        train(cfg, extra_metrics=lambda model, evaluation: {"head_norm": model.lm_head.weight.detach().norm()})
    with pytest.raises(ValueError, match=r"extra_metrics returned a list; return a dict"):
        train(cfg, extra_metrics=lambda model, evaluation: [1.0])
    # control: the same metric as a float is logged at every evaluation
    head_norm = lambda model, evaluation: {"head_norm": float(model.lm_head.weight.detach().norm())}  # noqa: E731
    result = train(cfg, extra_metrics=head_norm)
    assert [math.isfinite(record["head_norm"]) for record in result.evals] == [True, True]
