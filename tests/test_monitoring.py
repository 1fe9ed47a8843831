"""Activation monitoring with forward hooks (geomuon.pretrain.monitoring)."""

import math

import pytest
import torch
import torch.nn as nn

from geomuon.pretrain.model import GPT, GPTConfig
from geomuon.pretrain.monitoring import ActivationMonitor, default_blocks


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class Stack(nn.Module):
    """blocks[i] multiplies by factors[i]; `pair` returns a tuple (a, -2a)."""

    def __init__(self, factors):
        super().__init__()
        self.blocks = nn.ModuleList(Scale(f) for f in factors)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Pair(nn.Module):
    def forward(self, x):
        return x, {"doubled": -2 * x, "index": torch.arange(3)}


def test_records_the_running_max_per_block():
    model = Stack([2.0, -3.0, 0.5])
    with ActivationMonitor(model) as monitor:
        model(torch.tensor([1.0, -4.0]))
        model(torch.tensor([0.5, 1.0]))  # smaller: the maxima stay
    # block outputs on the first input: [2, -8], [-6, 24], [-3, 12]
    assert monitor.summary() == {"blocks.0": 8.0, "blocks.1": 24.0, "blocks.2": 12.0, "max": 24.0}
    monitor.reset()
    assert monitor.summary() == {}


def test_hooks_are_removed_on_exit():
    model = Stack([2.0])
    with ActivationMonitor(model) as monitor:
        model(torch.ones(1))
    model(torch.full((1,), 100.0))  # outside the context: not recorded
    assert monitor.summary()["blocks.0"] == 2.0
    assert not model.blocks[0]._forward_hooks


def test_selection_by_names_mapping_and_predicate():
    model = Stack([2.0, 3.0])
    x = torch.ones(2)
    by_name = ActivationMonitor(model, ["blocks.1"])
    by_map = ActivationMonitor(model, {"first": model.blocks[0]})
    by_rule = ActivationMonitor(model, lambda name, module: isinstance(module, Scale))
    for monitor in (by_name, by_map, by_rule):
        with monitor:
            model(x)
    assert by_name.summary() == {"blocks.1": 6.0, "max": 6.0}
    assert by_map.summary() == {"first": 2.0, "max": 2.0}
    assert set(by_rule.summary()) == {"blocks.0", "blocks.1", "max"}
    with pytest.raises(ValueError, match="no submodule named"):
        ActivationMonitor(model, ["blocks.7"])
    with pytest.raises(ValueError, match="no module selected"):
        ActivationMonitor(model, lambda name, module: False)
    with pytest.raises(TypeError, match="nn.Module"):
        ActivationMonitor(lambda x: x)


def test_nested_outputs_nan_and_bf16():
    model = nn.Sequential(Pair())
    with ActivationMonitor(model, ["0"]) as monitor:
        model(torch.tensor([1.5, -0.5], dtype=torch.bfloat16))
    assert monitor.summary()["0"] == 3.0  # from the dict entry -2x; integer tensors ignored
    with monitor:
        model(torch.tensor([math.nan]))
    assert math.isnan(monitor.summary()["0"]) and math.isnan(monitor.summary()["max"])


def test_default_blocks_of_a_gpt():
    config = GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=8)
    model = GPT(config)
    assert list(default_blocks(model)) == ["h.0", "h.1"]
    idx = torch.randint(0, 16, (2, 8))
    with ActivationMonitor(model) as monitor, torch.no_grad():
        model(idx)
        expected = model.embed(idx)
        peaks = []
        for block in model.h:
            expected = block(expected)
            peaks.append(expected.abs().max().item())
    summary = monitor.summary()
    assert [summary["h.0"], summary["h.1"]] == pytest.approx(peaks, rel=0, abs=0)


def test_models_without_module_lists_fall_back_to_leaves():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    assert list(default_blocks(model)) == ["0", "1"]


def test_float64_maxima_are_reported_exactly():
    # a float64 model's maxima had been cast to fp32: 1 + 2^-40 rounded to 1, 1e300 overflowed to inf
    model = Stack([1 + 2.0**-40, 1e300])
    with ActivationMonitor(model) as monitor:
        model(torch.ones(2, dtype=torch.float64))
    assert monitor.summary() == {"blocks.0": 1 + 2.0**-40, "blocks.1": (1 + 2.0**-40) * 1e300,
                                 "max": (1 + 2.0**-40) * 1e300}


def test_a_module_s_outputs_of_several_dtypes_keep_the_widest():
    # bf16 and float64 outputs of one module: the running max is promoted (torch.maximum), not
    # narrowed to the first output's dtype; 1 + 2^-40 is not a bf16 (nor an fp32) number
    model = nn.Sequential(Pair())
    with ActivationMonitor(model, ["0"]) as monitor:
        model(torch.tensor([1.0], dtype=torch.bfloat16))   # max 2 (the doubled entry), bf16
        model(torch.tensor([0.5 + 2.0**-41], dtype=torch.float64))  # max 1 + 2^-40 < 2
        model(torch.tensor([1.0 + 2.0**-40], dtype=torch.float64))  # max 2 + 2^-39 > 2
    assert monitor.summary()["0"] == 2 + 2.0**-39


def test_names_given_as_a_generator_are_all_monitored():
    # the generator had been used up by the check for unknown names: "no module selected"
    model = Stack([2.0, 3.0])
    with ActivationMonitor(model, (f"blocks.{i}" for i in range(2))) as monitor:
        model(torch.ones(1))
    assert monitor.summary() == {"blocks.0": 2.0, "blocks.1": 6.0, "max": 6.0}
    with pytest.raises(ValueError, match=r"no submodule named \['blocks.7'\]"):
        ActivationMonitor(model, (name for name in ["blocks.0", "blocks.7"]))


class Experts(nn.Module):
    """A block holding its own ModuleList: the sum of its experts' outputs, halved."""

    def __init__(self, factors):
        super().__init__()
        self.experts = nn.ModuleList(Scale(f) for f in factors)

    def forward(self, x):
        return sum(expert(x) for expert in self.experts) / 2


def test_a_module_list_inside_a_block_is_part_of_the_block():
    # the experts of a mixture (h.0.mlp.experts.i) had been monitored as blocks too, so "max"
    # was an expert's output (10 here), not a block's (the experts' mean, 5.5). Control: the
    # MoE GPT's default blocks are its transformer blocks.
    model = Stack([1.0])
    model.blocks.append(Experts([10.0, 1.0]))
    assert list(default_blocks(model)) == ["blocks.0", "blocks.1"]
    with ActivationMonitor(model) as monitor:
        model(torch.ones(1))
    assert monitor.summary() == {"blocks.0": 1.0, "blocks.1": 5.5, "max": 5.5}
    moe = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=8, mlp="swiglu", n_experts=4,
                        moe_top_k=2))
    assert list(default_blocks(moe)) == ["h.0", "h.1"]
