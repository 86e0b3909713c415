"""plan_checkpointing(model, inputs, peak_bytes=...): a plan for one training step's measured peak,
on Hugging Face models built from tiny configs and on an LSTM stack."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import ckptlib
from ckptlib import apply_checkpointing
from tests._grads import assert_same_step, seeded_step
from tests._misuse import assert_nothing_installed
from tests._models import hf_gpt2, hf_transformers

VOCAB = 128
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
INPUTS = {"input_ids": IDS, "labels": IDS, "use_cache": False}


def gpt2() -> nn.Module:
    return hf_gpt2(n_layer=3, n_positions=64, vocab_size=VOCAB, bos_token_id=0,
                   eos_token_id=0).train()


def step_peak(model: nn.Module, inputs: dict) -> int:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()

    peak = ckptlib.measure(step, timeline=False).peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


def test_three_budgets_between_full_checkpointing_and_plain_each_measure_under_it():
    model = gpt2()
    plain = step_peak(model, INPUTS)
    with apply_checkpointing(model):
        full = step_peak(model, INPUTS)
    assert full < plain
    for share in (0.75, 0.4, 0.05):
        budget = int(full + share * (plain - full))
        plan = ckptlib.plan_checkpointing(model, INPUTS, peak_bytes=budget)
        assert plan.plain_peak_bytes == plain and plan.module_paths()
        assert plan.measured_peak_bytes <= budget
        with apply_checkpointing(model, plan) as handle:
            assert handle.paths == list(plan.module_paths())
            assert step_peak(model, INPUTS) == plan.measured_peak_bytes <= budget
    assert all(p.grad is None for p in model.parameters())   # the planner left no gradients


def test_the_same_plan_on_two_runs_and_it_trains_bitwise():
    model = gpt2()
    plain = step_peak(model, INPUTS)
    with apply_checkpointing(model):
        full = step_peak(model, INPUTS)
    budget = (plain + full) // 2
    plans = [ckptlib.plan_checkpointing(gpt2(), INPUTS, peak_bytes=budget) for _ in range(2)]
    assert plans[0] == plans[1]
    assert plans[0].module_hows() == plans[1].module_hows()
    expected = seeded_step(model, lambda: model(**INPUTS).loss)
    with apply_checkpointing(model, plans[0]):
        assert_same_step(expected, seeded_step(model, lambda: model(**INPUTS).loss))


def test_a_budget_no_plan_meets_is_a_value_error_naming_the_least_peak_reached():
    model = gpt2()
    with apply_checkpointing(model):
        full = step_peak(model, INPUTS)
    with pytest.raises(ValueError, match=(
            r"no plan keeps one training step within peak_bytes=1,000: plain autograd's step "
            r"peaks at [\d,]+ bytes \(at \w+, .*\), and the least this planner reaches, every one "
            r"of the 3 candidate modules checkpointed, peaks at ([\d,]+) .*Raise peak_bytes")) as e:
        ckptlib.plan_checkpointing(model, INPUTS, peak_bytes=1000)
    least = int(e.value.args[0].split("checkpointed, peaks at ")[1].split(" ")[0].replace(",", ""))
    assert least <= full
    assert_nothing_installed()
    assert not any("forward" in vars(module) for module in model.modules())


def test_the_printed_plan_and_handle_are_tables_and_say_what_the_budget_bounds():
    model = gpt2()
    plan = ckptlib.plan_checkpointing(model, INPUTS, peak_bytes=10**9)
    lines = str(plan).splitlines()
    assert lines[0].split() == ["module", "how", "kept", "bytes", "rerun", "cost"]
    assert [line.split()[:2] for line in lines[1:4]] == [[f"transformer.h.{i}", "keep"]
                                                         for i in range(3)]
    assert lines[-1].startswith("one training step's peak (forward, loss, backward, gradients): "
                                f"measured {plan.measured_peak_bytes:,} <= budget 1,000,000,000")
    assert plan.module_paths() == ()           # plain fits: nothing to rerun
    assert all(way.how != "offload" for ways in plan.ways for way in ways)   # frees nothing here
    with apply_checkpointing(model) as handle:
        lines = str(handle).splitlines()
    assert lines[0].split() == ["module", "how", "kept", "bytes", "rerun", "cost"]
    assert lines[1].split() == ["transformer.h.0", "full", "-", "-"]
    kept = ckptlib.plan_checkpointing(model, INPUTS, budget_bytes=10**9)
    assert "activations kept for backward (not the step's peak" in str(kept).splitlines()[-1]


def test_optimizer_state_counts_toward_the_budget():
    model = gpt2()
    plain = ckptlib.plan_checkpointing(model, INPUTS, peak_bytes=10**9)
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = plain.plain_peak_bytes + state - 1
    with_state = ckptlib.plan_checkpointing(model, INPUTS, peak_bytes=budget,
                                            optimizer_state_bytes=state)
    assert with_state.plain_peak_bytes == plain.plain_peak_bytes + state
    assert with_state.module_paths() and with_state.measured_peak_bytes <= budget
    assert "and optimizer state" in str(with_state)


def test_offloading_a_cpu_model_warns_that_it_frees_nothing():
    model = gpt2()
    with pytest.warns(UserWarning, match=r"offload.*lives on the CPU.*frees nothing"):
        apply_checkpointing(model, how="offload").remove()
    assert not any("forward" in vars(module) for module in model.modules())


def test_the_default_covers_both_of_t5s_stacks():
    transformers = hf_transformers()
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).train()
    ids = IDS[:, :16].contiguous()
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    stacks = [f"{stack}.block.{i}" for stack in ("encoder", "decoder") for i in range(2)]
    with apply_checkpointing(model) as handle:
        assert handle.paths == stacks
    plain = step_peak(model, inputs)
    plan = ckptlib.plan_checkpointing(model, inputs, peak_bytes=plain * 3 // 4)
    assert list(plan.paths) == stacks and plan.measured_peak_bytes <= plain * 3 // 4


class LSTMBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, width, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lstm(x)[0]


class LSTMStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(LSTMBlock(16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_an_lstms_rerun_costs_its_measured_time_not_zero_flops():
    model, x = LSTMStack(), torch.randn(2, 12, 16)
    flops = ckptlib.plan_checkpointing(model, x, budget_bytes=0 + 10**9)
    assert flops.forward_flops == 0          # the FLOP counter cannot see an LSTM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # CPU LSTM: no cuDNN notes
        plan = ckptlib.plan_checkpointing(model, x, peak_bytes=10**9)
    full = [way for way in plan.ways[0] if way.how == "full"]
    assert full and full[0].rerun_s > 0 and full[0].dropped_bytes > 0
