"""apply_checkpointing(model, how=<a Plan>): the plan's layers are the selected ones, in order."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ckptlib
from ckptlib.schedules import Segment
from tests._grads import assert_bitwise_equal


def grads(model: nn.Module, step) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_one_layer_segments_checkpoint_those_layers_in_a_module_list():
    torch.manual_seed(0)
    model = ckptlib.TinyTransformer(depth=4)
    batch = model.example_batch()
    plain = grads(model, lambda: model.loss(batch))
    plan = ckptlib.Plan([Segment(0, 1), 1, Segment(2, 3), 3], name="first and third")
    with ckptlib.apply_checkpointing(model, how=plan) as handle, ckptlib.record_trace() as trace:
        got = grads(model, lambda: model.loss(batch))
    assert handle.paths == ["blocks.0", "blocks.2"] and "plan first and third" in str(handle)
    assert {event.region.name for event in trace.events} == {"blocks.0", "blocks.2"}
    assert_bitwise_equal(got, plain)
    assert all("forward" not in vars(block) for block in model.blocks)


def test_a_sequential_runs_multi_layer_segments_under_the_plan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                                                           for _ in range(6)]))
    x = torch.randn(4, 8)
    keys = list(model.state_dict())
    plain = grads(model, lambda: model(x).square().sum())
    plan = ckptlib.sqrt_n(6)
    with ckptlib.apply_checkpointing(model, "1.*", how=plan) as handle:
        with ckptlib.record_trace() as trace:
            got = grads(model, lambda: model(x).square().sum())
        assert handle.paths == ["1"] and list(model.state_dict()) == keys
    assert trace.count("recompute") == sum(1 for step in plan.body if not isinstance(step, int))
    assert_bitwise_equal(got, plain)
    assert ckptlib.measure(lambda: model[1](model[0](x))).peak_bytes > 0
    assert "forward" not in vars(model[1])


class Looped(nn.Module):
    """Layers in a ModuleList, called one by one by the model's own loop (as Hugging Face does)."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).tanh()
        return x


def test_one_layer_segments_work_over_a_module_list_and_longer_ones_are_refused():
    torch.manual_seed(0)
    model, x = Looped(), torch.randn(2, 8)
    plain = grads(model, lambda: model(x).sum())
    with ckptlib.apply_checkpointing(model, how=ckptlib.uniform(4, 4)) as handle:
        got = grads(model, lambda: model(x).sum())
    assert handle.paths == [f"layers.{i}" for i in range(3)]   # the last segment is kept
    assert_bitwise_equal(got, plain)
    with pytest.raises(ValueError, match=r"ModuleList.*uniform\(4, 4\).*checkpoint_sequential"):
        ckptlib.apply_checkpointing(model, how=ckptlib.Plan([Segment(0, 2), 2, 3]))
    assert ckptlib.remove_checkpointing(model) == []   # nothing was wrapped


@pytest.mark.parametrize("kwargs, words", [
    ({"how": ckptlib.sqrt_n(3)}, "the plan is for 3 layers and select chose 4"),
    ({"how": ckptlib.uniform(4, 4), "every_n": 2}, "every_n=2 and a plan"),
])
def test_a_plan_that_does_not_fit_the_selection_is_refused(kwargs, words):
    model = ckptlib.TinyTransformer(depth=4)
    with pytest.raises(ValueError, match=words):
        ckptlib.apply_checkpointing(model, **kwargs)
    assert ckptlib.remove_checkpointing(model) == []
