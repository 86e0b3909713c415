"""ckptlib.sequential: plans run as nested checkpoints do what they claim, bitwise."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

from ckptlib import record_trace
from ckptlib import is_recomputing
from ckptlib.memory import measure
from ckptlib.models import MLPChain
from ckptlib.schedules import (
    LayerCost, Plan, Segment, plan_for_budget, recursive, revolve, sqrt_n, uniform,
)
from ckptlib.sequential import checkpoint_sequential, measure_layer_costs
from tests._grads import assert_bitwise_equal
from tests._misuse import assert_nothing_installed

N = 16


def mlp_chain(n: int = N, width: int = 8, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [
        nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout)) for _ in range(n)
    ]
    return nn.Sequential(*blocks)


def output_and_grads(run, chain: nn.Module, x: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    """``run()``'s output, then the gradients of its squared sum w.r.t. ``x`` and the parameters."""
    chain.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    out = run()
    out.square().sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in chain.parameters())]


def every_plan(n: int = N) -> list[Plan]:
    return [
        uniform(n, 1),
        uniform(n, 4),
        uniform(n, 5),
        uniform(n, n),
        sqrt_n(n),
        recursive(n),
        revolve(n, 1),
        revolve(n, 2),
        revolve(n, 3),
        revolve(n, 6),
        plan_for_budget([LayerCost(1, 2, 1.0)] * n, 7),
        Plan(
            [Segment(0, 6, (Segment(0, 3), 3, Segment(4, 6))), *range(6, n - 1), Segment(n - 1, n)]
        ),
    ]


# ---------------------------------------------------------------------------
# An int: torch's checkpoint_sequential, exactly
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("segments", [1, 2, 3, 5, 7, 16])
def test_int_segments_match_torch_checkpoint_sequential(segments):
    chain = mlp_chain(dropout=0.2)
    x = torch.randn(4, 8, requires_grad=True)
    ours = output_and_grads(lambda: checkpoint_sequential(chain, segments, x), chain, x)
    theirs = output_and_grads(
        lambda: torch_checkpoint_sequential(chain, segments, x, use_reentrant=False), chain, x)
    assert_bitwise_equal(ours, theirs)
    plain = output_and_grads(lambda: chain(x), chain, x)
    assert_bitwise_equal(ours, plain)


def test_int_segments_run_the_uniform_plan():
    chain = mlp_chain()
    calls = count_calls(chain)
    x = torch.randn(4, 8, requires_grad=True)
    checkpoint_sequential(chain, 5, x).sum().backward()
    assert [layer for layer, _ in calls] == forward_order(uniform(N, 5))


@pytest.mark.parametrize(
    "wrap", [list, tuple, nn.ModuleList, lambda blocks: nn.Sequential(*blocks)]
)
def test_modules_may_be_a_sequential_a_module_list_or_a_list(wrap):
    chain = mlp_chain()
    x = torch.randn(4, 8, requires_grad=True)
    expected = output_and_grads(lambda: chain(x), chain, x)
    modules = wrap(list(chain))
    assert_bitwise_equal(
        output_and_grads(lambda: checkpoint_sequential(modules, revolve(N, 2), x), chain, x),
        expected,
    )


def test_functions_are_layers_too():
    x = torch.randn(5, requires_grad=True)
    functions = [torch.sin, torch.exp, torch.cos, torch.tanh]
    y = checkpoint_sequential(functions, revolve(4, 1), x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    expected = torch.tanh(torch.cos(torch.exp(torch.sin(x))))
    assert torch.equal(y, expected)
    assert torch.equal(grad, torch.autograd.grad(expected.sum(), x)[0])


# ---------------------------------------------------------------------------
# A plan: bitwise gradients, and the module calls it predicts
# ---------------------------------------------------------------------------


def count_calls(chain: nn.Sequential) -> list[tuple[int, bool]]:
    """(layer, called while recomputing) for every call of a layer; pre-hooks see a call even
    when early stop cuts it short inside the layer."""
    calls: list[tuple[int, bool]] = []
    for index, layer in enumerate(chain):
        layer.register_forward_pre_hook(
            lambda module, args, index=index: calls.append((index, is_recomputing()))
        )
    return calls


def forward_order(plan: Plan) -> list[int]:
    return [layer for action in plan.actions if action.op == "forward"
            for layer in range(action.start, action.stop)]


@pytest.mark.parametrize("plan", every_plan(), ids=lambda plan: plan.name)
def test_plans_give_plain_gradients_bitwise(plan):
    chain = mlp_chain(dropout=0.1)
    x = torch.randn(4, 8, requires_grad=True)
    assert_bitwise_equal(output_and_grads(lambda: checkpoint_sequential(chain, plan, x), chain, x),
                         output_and_grads(lambda: chain(x), chain, x))


@pytest.mark.parametrize("plan", every_plan(), ids=lambda plan: plan.name)
def test_module_calls_follow_the_plan(plan):
    chain = mlp_chain()
    calls = count_calls(chain)
    x = torch.randn(4, 8, requires_grad=True)
    checkpoint_sequential(chain, plan, x).sum().backward()
    assert [layer for layer, _ in calls] == forward_order(plan)
    assert len(calls) == plan.forward_calls
    assert sum(recomputing for _, recomputing in calls) == plan.forward_steps


def test_revolve_calls_match_griewank_walther_for_longer_chains():
    chain = mlp_chain(n=40, width=4)
    calls = count_calls(chain)
    x = torch.randn(2, 4, requires_grad=True)
    for slots in (2, 4):
        calls.clear()
        plan = revolve(40, slots)
        checkpoint_sequential(chain, plan, x).sum().backward()
        assert (
            sum(recomputing for _, recomputing in calls) == plan.forward_steps
        )  # r*l - C(s+r, s+1)


def test_without_grad_the_chain_runs_once_plainly():
    chain = mlp_chain()
    calls = count_calls(chain)
    x = torch.randn(4, 8)
    with torch.no_grad():
        y = checkpoint_sequential(chain, revolve(N, 2), x)
    assert torch.equal(y, chain(x))
    assert [layer for layer, _ in calls[:N]] == list(range(N))


def test_regions_are_named_after_their_layers():
    chain = mlp_chain(n=4)
    x = torch.randn(2, 8, requires_grad=True)
    with record_trace() as trace:
        checkpoint_sequential(
            chain, Plan([Segment(0, 2), Segment(2, 4, (Segment(2, 3), 3))]), x
        ).sum().backward()
    regions = {event.region.name for event in trace.events}
    assert regions == {"layers[0:2]", "layers[2:4]", "layers[2:3]"}


def test_models_accept_a_plan():
    model = MLPChain(depth=8, width=16)
    batch = model.example_batch(batch=4)
    model.training_step(batch)
    expected = [p.grad.clone() for p in model.parameters()]
    model.checkpointing = revolve(8, 2)
    model.training_step(batch)
    assert_bitwise_equal([p.grad for p in model.parameters()], expected)


# ---------------------------------------------------------------------------
# Memory: the measured peak stays within what the plan predicts
# ---------------------------------------------------------------------------


def test_measured_peak_is_within_the_plans_prediction():
    # Wide batch, narrow layers: activations dominate the parameters, as in the course's models.
    batch, width = 256, 16
    torch.manual_seed(0)
    chain = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(N)))
    x = torch.randn(batch, width)
    costs = measure_layer_costs(chain, x)
    activation = batch * width * 4
    assert costs[3] == LayerCost(
        activation, 2 * activation, costs[3].forward_s
    )  # Linear input, ReLU output
    # Not part of a plan's peak: the gradients of the parameters (allocated by every step, since
    # they are reset to None) and what is in flight, the current activation and its gradient.
    not_planned = sum(p.numel() * p.element_size() for p in chain.parameters()) + 2 * activation

    def step(plan):
        chain.zero_grad(set_to_none=True)
        checkpoint_sequential(chain, plan, x).sum().backward()

    measured = {}
    for plan in [uniform(N, 1), sqrt_n(N), recursive(N), revolve(N, 1), revolve(N, 4),
                 plan_for_budget(costs, 6 * activation)]:
        measured[plan.name] = peak = measure(lambda: step(plan), timeline=False).peak_bytes
        assert peak <= plan.peak_bytes(costs) + not_planned, (plan.name, peak / activation)
    assert measured["revolve(16, slots=1)"] < measured["uniform(16, 1)"] / 3


def test_measure_layer_costs_sees_what_each_layer_saves():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)]
    costs = measure_layer_costs(layers, torch.randn(4, 8), repeat=2)
    # float32: 4 x 8 -> 128 bytes, 4 x 32 -> 512 bytes. GELU saves its input; weights are excluded.
    assert [(c.input_bytes, c.saved_bytes) for c in costs] == [(128, 128), (512, 512), (512, 512)]
    assert all(c.forward_s > 0 for c in costs)
    plan = plan_for_budget(costs, 700)
    assert plan.peak_bytes(costs) <= 700
    with pytest.raises(ValueError, match="repeat must be an integer >= 1"):
        measure_layer_costs(layers, torch.randn(4, 8), repeat=0)


# ---------------------------------------------------------------------------
# Bad arguments
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "segments, message",
    [
        (0, "segments=0 must be between 1 and the number of modules \\(16\\)"),
        (-2, "segments=-2 must be between 1 and the number of modules"),
        (17, "segments=17 must be between 1 and the number of modules \\(16\\)"),
        (
            2.5,
            "segments must be an int \\(the number of segments\\) or a ckptlib.schedules.Plan, got "
            "2.5",
        ),
        ("4", "got '4' \\(str\\)"),
        (True, "got True \\(bool\\)"),
        (
            revolve(8, 2),
            "the plan revolve\\(8, slots=2\\) is for 8 layers, but there are 16 modules",
        ),
    ],
)
def test_bad_segments_are_value_errors(segments, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_sequential(mlp_chain(), segments, torch.randn(2, 8))


@pytest.mark.parametrize(
    "modules, message",
    [
        (
            nn.Linear(8, 8),
            "must be an nn.Sequential, an nn.ModuleList or a list of modules, got Linear",
        ),
        ({"a": nn.Tanh()}, "got dict"),
        (iter([nn.Tanh()]), "got list_iterator"),
        ([nn.Tanh(), 3], "modules\\[1\\] is not a module or function \\(got int\\)"),
    ],
)
def test_bad_modules_are_type_errors(modules, message):
    with pytest.raises(TypeError, match=message):
        checkpoint_sequential(modules, 1, torch.randn(2, 8))


def test_reentrant_is_refused():
    with pytest.raises(ValueError, match="always non-reentrant; drop use_reentrant=True"):
        checkpoint_sequential(mlp_chain(), 2, torch.randn(2, 8), use_reentrant=True)
    y = checkpoint_sequential(mlp_chain(), 2, torch.randn(2, 8), use_reentrant=False)
    assert y.shape == (2, 8)


# ---------------------------------------------------------------------------
# Modules that return tuples
# ---------------------------------------------------------------------------


class PairBlock(nn.Module):
    """Takes a pair (or, first, one tensor) and returns a pair: a layer that passes a tuple on."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        h = x if isinstance(x, torch.Tensor) else x[0] * x[1].sigmoid()
        h = self.linear(h)
        return h.tanh(), h.relu()


@pytest.mark.parametrize("segments", [1, 2, 4, sqrt_n(6)], ids=["1", "2", "4", "sqrt_n"])
def test_a_tuple_is_passed_on_as_one_input_as_torch_does(segments):
    torch.manual_seed(0)
    chain = nn.Sequential(*(PairBlock() for _ in range(6)))
    x = torch.randn(3, 8, requires_grad=True)

    def run(forward):
        first, second = forward()
        return first * second

    ours = output_and_grads(lambda: run(lambda: checkpoint_sequential(chain, segments, x)),
                            chain, x)
    plain = output_and_grads(lambda: run(lambda: chain(x)), chain, x)
    assert_bitwise_equal(ours, plain)
    if isinstance(segments, int):
        theirs = output_and_grads(lambda: run(lambda: torch_checkpoint_sequential(
            chain, segments, x, use_reentrant=False)), chain, x)
        assert_bitwise_equal(ours, theirs)


class Flatten(nn.Module):
    def forward(self, x):
        return x.flatten(1)


def test_a_module_that_wants_a_tensor_and_gets_a_tuple_fails_as_in_torch_with_a_note():
    chain = nn.Sequential(PairBlock(), Flatten(), nn.Linear(8, 8))
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'flatten'"):
        torch_checkpoint_sequential(chain, 2, x, use_reentrant=False)
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'flatten'") as error:
        checkpoint_sequential(chain, 2, x)
    assert error.value.__notes__ == [
        "checkpoint_sequential: modules[1] was called with a tuple (what modules[0] returned) as "
        "its one argument. Each module's output is passed on as the next one's single input, as "
        "in torch.utils.checkpoint.checkpoint_sequential: make modules[1] take the tuple, or have "
        "the module before it return one tensor."]
    with pytest.raises(TypeError, match="must be Tensor, not tuple") as error:
        checkpoint_sequential([nn.Linear(8, 8)], 1, (x,))
    assert "was called with a tuple (the input)" in error.value.__notes__[0]
    assert_nothing_installed()
