"""Copies of a model after ckptlib.apply_checkpointing: deep copies, AveragedModel, the layer
clones of nn.TransformerEncoder, shallow copies, pickle and torch.save. Each copy runs its own
layers, checkpointed, and gives what the same copy of a plain model gives, to the bit."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

import ckptlib
from ckptlib import apply_checkpointing, record_trace, remove_checkpointing
from tests._grads import assert_same_step, seeded_step
from tests.models.test_apply import Net, batch


def step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return seeded_step(model, lambda: model(*batch()).square().mean())


def rerun_regions(model: nn.Module) -> set[str]:
    """The checkpoint regions that ran again in one training step of ``model``."""
    with record_trace() as trace:
        step(model)
    return {event.region.name for event in trace.events if event.kind == "recompute"}


def test_a_deep_copy_runs_its_own_layers_and_gets_its_own_gradients():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    apply_checkpointing(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in clone.parameters():
            parameter.zero_()
    out = clone(torch.randn(2, 4))
    assert torch.equal(out, torch.zeros(2, 4))
    out.sum().backward()
    assert all(p.grad is not None for p in clone.parameters())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("how", ["full", "offload", ckptlib.save_matmuls],
                         ids=["full", "offload", "save_matmuls"])
def test_a_deep_copy_steps_as_a_deep_copy_of_the_plain_model_and_stays_checkpointed(how):
    plain, model = Net(), Net()
    handle = apply_checkpointing(model, how=how)
    plain_copy, clone = copy.deepcopy(plain), copy.deepcopy(model)
    with torch.no_grad():   # the copies part ways with their originals
        for parameter in [*plain_copy.parameters(), *clone.parameters()]:
            parameter.mul_(0.5)
    assert_same_step(step(plain_copy), step(clone))
    assert_same_step(step(plain), step(model))
    if how == "full":
        assert rerun_regions(clone) == set(handle.paths)
    # the copy is undone on its own; the original stays checkpointed
    assert remove_checkpointing(clone) == handle.paths
    assert all("forward" in vars(layer) for layer in model.layers)
    assert_same_step(step(plain_copy), step(clone))


def test_averaged_model_evaluates_with_its_own_average_not_the_live_layers():
    def run(checkpointed: bool) -> list[torch.Tensor]:
        model = Net()
        if checkpointed:
            apply_checkpointing(model)
        average = AveragedModel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        outputs = []
        for _ in range(3):
            step(model)
            optimizer.step()
            average.update_parameters(model)
            outputs.append(average(*batch()).detach())
        outputs.append(model(*batch()).detach())
        return outputs

    plain, checkpointed = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
    assert not torch.equal(checkpointed[-2], checkpointed[-1])   # the average is not the model


def test_transformer_encoder_clones_of_a_checkpointed_layer_each_get_their_gradients():
    def encoder(checkpointed: bool) -> nn.TransformerEncoder:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        if checkpointed:
            apply_checkpointing(layer, lambda path, module: path == "")
        return nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)

    x = torch.randn(2, 5, 8)
    plain, model = encoder(False), encoder(True)
    expected = seeded_step(plain, lambda: plain(x).square().mean())
    got = seeded_step(model, lambda: model(x).square().mean())
    assert_same_step(expected, got)
    assert len(got[1]) == len(list(model.parameters()))   # no clone's gradient is None
    with record_trace() as trace:
        seeded_step(model, lambda: model(x).square().mean())
    assert trace.count("recompute") == 3


def test_a_shallow_copy_shares_the_layers_as_on_the_plain_model():
    plain, model = Net(), Net()
    apply_checkpointing(model)
    plain_copy, shallow = copy.copy(plain), copy.copy(model)
    assert all(a is b for a, b in zip(shallow.parameters(), model.parameters()))
    assert_same_step(step(plain_copy), step(shallow))
    assert rerun_regions(shallow) == {f"layers.{i}" for i in range(4)}
    assert all(p.grad is not None for p in model.parameters())   # shared, as plain's are

    layer = Net().layers[0]   # a module that is itself checkpointed: the same parameters
    apply_checkpointing(layer, lambda path, module: path == "")
    x = torch.randn(2, 16)
    assert torch.equal(copy.copy(layer)(x), layer(x))


def saved_and_loaded(model: nn.Module, through: str) -> nn.Module:
    if through == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)   # a whole model, as for a plain one


@pytest.mark.parametrize("through", ["pickle", "torch.save"])
def test_a_saved_model_loads_checkpointed_with_its_own_weights(through):
    plain, model = Net(), Net()
    handle = apply_checkpointing(model)
    loaded_plain, loaded = saved_and_loaded(plain, through), saved_and_loaded(model, through)
    with torch.no_grad():   # the original changes; the loaded copy must not follow it
        for parameter in [*plain.parameters(), *model.parameters()]:
            parameter.zero_()
    assert_same_step(step(loaded_plain), step(loaded))
    assert rerun_regions(loaded) == set(handle.paths)
    assert remove_checkpointing(loaded) == handle.paths
    assert rerun_regions(loaded) == set()
    assert_same_step(step(loaded_plain), step(loaded))


@pytest.mark.parametrize(
    "how, plans",
    [("offload", None), (ckptlib.save_matmuls, None), (ckptlib.save_matmuls, "plans"),
     (ckptlib.megatron_attention, None), (torch.ops.aten.addmm.default, None)],
    ids=["offload", "save_matmuls", "save_matmuls-with-plans", "megatron_attention",
         "one-op"],
)
def test_every_way_of_checkpointing_pickles_and_computes_the_same_after(how, plans):
    plain, model = Net(), Net()
    plans = ckptlib.SelectivePlans() if plans else None
    apply_checkpointing(model, how=how, plans=plans)
    expected = step(plain)
    assert_same_step(expected, step(model))
    loaded = pickle.loads(pickle.dumps(model))
    assert_same_step(expected, step(loaded))
    assert_same_step(expected, step(loaded))   # a second step: a copy's plans are its own
    if plans is not None:
        assert plans.recorded == len(model.layers)


def test_a_plan_over_a_sequential_pickles_and_copies():
    torch.manual_seed(0)
    chain = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)))
    plain = copy.deepcopy(chain)
    model = nn.Sequential(chain)
    apply_checkpointing(model, "0.*", how=ckptlib.revolve(6, 2))
    x = torch.randn(3, 8)
    expected = seeded_step(plain, lambda: plain(x).sum())
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert_same_step(expected, seeded_step(copied[0], lambda: copied(x).sum()))
        assert remove_checkpointing(copied) == ["0"]


def test_the_handle_of_a_copy_says_how_to_undo_the_copy():
    model = Net()
    handle = apply_checkpointing(model)
    with pytest.raises(ValueError, match=r"remove_checkpointing\(copy\)"):
        copy.deepcopy(handle).remove()
    handle.remove()
    assert remove_checkpointing(model) == []
