"""The training loop: schedule, metrics, JSONL log, the GPT-2 entry point, bad configs."""

import json
import math
import os

import pytest
import torch

from geomuon.cli import main as cli
from geomuon.optimizers.assign import ATTENTION_ROLES, STRATEGIES, Hyper, Rule, assign
from geomuon.pretrain.data import load_data
from geomuon.pretrain.model import GPT, get_config
from geomuon.pretrain.train import TrainConfig, _check_same_run, lr_factor, owners, train


def tiny(tmp_path, **overrides):
    base = dict(model="cpu-tiny", strategy="adamw", steps=12, batch_size=4, block_size=32, eval_every=6,
                eval_batches=1, warmup_steps=2, adamw_lr=3e-3, out_dir=str(tmp_path / "run"), progress=False,
                print_table=False)
    return TrainConfig(**{**base, **overrides})


def test_warmup_then_cosine():
    cfg = TrainConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(60, cfg) == pytest.approx(0.55)  # half way through the cosine
    assert lr_factor(110, cfg) == pytest.approx(0.1)
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


def test_extra_metrics_hook_sees_the_evaluated_windows(tmp_path):
    """The hook runs at every evaluation on the windows ``evaluate`` scores: its own loss on
    ``evaluation.windows()`` equals the recorded val loss; ``val_seed`` picks the windows
    and ``final_eval_batches`` enlarges the last evaluation."""
    data = load_data("embedded")
    calls = []

    def own_loss(model, evaluation):
        losses = [model(x, y)[1].item() for x, y in evaluation.windows()]
        calls.append((evaluation.step, evaluation.batches, evaluation.seed))
        return {"own_val_loss": sum(losses) / len(losses)}

    cfg = tiny(tmp_path, out_dir=None, val_seed=7, final_eval_batches=3)
    result = train(cfg, data, extra_metrics=own_loss)
    assert calls == [(0, 1, 7), (6, 1, 7), (12, 3, 7)]
    for record in result.evals:  # same fp32 forward on the same windows; only the sum order differs
        assert record["own_val_loss"] == pytest.approx(record["val_loss"], rel=1e-6)
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
    with pytest.raises(ValueError, match=r"block_size is set by both --block-size and --model-overrides"):
        train(tiny(tmp_path, model_overrides={"block_size": 16}))
    with pytest.raises(ValueError, match=r"--resume needs an --out-dir"):
        train(tiny(tmp_path, out_dir=None, resume=True))
    with pytest.raises(ValueError, match=r"--final-eval-batches must be ≥ 1"):
        train(tiny(tmp_path, final_eval_batches=0))
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
    saved = {k: v for k, v in vars(cfg).items() if k != "model_overrides"}
    _check_same_run(saved, cfg)  # a checkpoint from before the field: its default, the same run
    with pytest.raises(ValueError, match=r"model_overrides: \{'mlp': 'swiglu'\} → \{\}"):
        _check_same_run({**saved, "model_overrides": {"mlp": "swiglu"}}, cfg)


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
