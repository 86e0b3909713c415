"""ckptlib.apply_checkpointing on plain PyTorch models: what is chosen, what it computes, and
undoing it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import ckptlib
from ckptlib import CheckpointError, apply_checkpointing, remove_checkpointing, record_trace
from tests._grads import assert_same_step
from tests._misuse import assert_nothing_installed


class Block(nn.Module):
    """A residual block that takes a mask and a scale by keyword, as Transformer layers do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, scale: float = 1.0
    ) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        if mask is not None:
            h = h * mask
        return x + scale * h


class Net(nn.Module):
    def __init__(self, depth: int = 4, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Sequential(
            nn.Linear(width, width), nn.Linear(width, 1)
        )  # repeated too, but shorter

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, mask=mask, scale=0.5)
        return self.head(x)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, generator=generator)
    mask = (torch.rand(3, 5, 1, generator=generator) > 0.3).float()
    return x, mask


def step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(*batch()).square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "how",
    ["full", "offload", ckptlib.save_matmuls, ckptlib.megatron_attention],
    ids=["full", "offload", "save_matmuls", "megatron_attention"],
)
def test_every_way_gives_plain_autograds_loss_and_gradients_bitwise(how):
    model = Net()
    plain = step(model)
    with apply_checkpointing(model, how=how) as handle:
        assert handle.paths == [
            "layers.0",
            "layers.1",
            "layers.2",
            "layers.3",
        ]  # not the 2-long head
        with record_trace() as trace:
            assert_same_step(plain, step(model))
    assert trace.count("recompute") == (0 if how == "offload" else 4)
    assert_nothing_installed()


def test_checkpointed_layers_are_rerun_and_their_keyword_arguments_reach_the_rerun():
    model = Net()
    plain = step(model)
    calls = []
    for layer in model.layers:
        layer.down.register_forward_hook(lambda module, args, output: calls.append(args[0].shape))
    with apply_checkpointing(model, "layers.*", every_n=2) as handle:
        assert handle.paths == ["layers.0", "layers.2"]
        calls.clear()
        assert_same_step(plain, step(model))
    assert len(calls) == 4 + 2     # each layer once in forward, layers 0 and 2 again in backward


def test_selection_by_class_pattern_and_predicate_and_nested_ones_are_left_to_the_outer():
    model = Net()
    assert apply_checkpointing(model, Block, every_n=3).paths == ["layers.0", "layers.3"]
    remove_checkpointing(model)
    assert apply_checkpointing(model, ["embed", "head.*"]).paths == ["embed", "head.0", "head.1"]
    remove_checkpointing(model)
    chosen = apply_checkpointing(
        model, lambda path, module: isinstance(module, nn.Linear) or path == "layers.1"
    )
    assert (
        "layers.1" in chosen.paths
        and "layers.1.up" not in chosen.paths
        and "layers.0.up" in chosen.paths
    )
    remove_checkpointing(model)


def test_state_dict_keys_and_parameters_unchanged_and_remove_gives_the_modules_their_forward_back():
    model = Net()
    keys, names = list(model.state_dict()), [name for name, _ in model.named_parameters()]
    before = model(*batch())
    handle = apply_checkpointing(model)
    assert (
        list(model.state_dict()) == keys and [name for name, _ in model.named_parameters()] == names
    )
    assert all("forward" in vars(layer) for layer in model.layers)
    handle.remove()
    assert all("forward" not in vars(layer) for layer in model.layers)
    assert torch.equal(model(*batch()), before)
    assert remove_checkpointing(model) == []


def test_remove_restores_an_instance_forward_someone_else_had_set():
    model = Net()
    layer = model.layers[0]
    own = layer.forward
    layer.forward = lambda x, **kwargs: own(x, **kwargs)   # as accelerate's hooks do
    previous = layer.forward
    apply_checkpointing(model, "layers.0")
    assert remove_checkpointing(model) == ["layers.0"]
    assert layer.forward is previous


def test_module_hooks_stay_outside_the_checkpoint_and_run_once():
    model = Net()
    calls = []
    model.layers[1].register_forward_pre_hook(lambda module, args: calls.append("pre"))
    with apply_checkpointing(model):
        step(model)
    assert calls == ["pre"]


def test_regions_are_named_by_module_path_in_traces_and_errors():
    model = Net()
    with apply_checkpointing(model, "layers.2"):
        with record_trace() as trace:
            step(model)
        assert {event.region.name for event in trace.events} == {"layers.2"}
        loss = model(*batch()).sum()
        with torch.no_grad():
            model.layers[2].up.weight.add_(1.0)      # an optimizer step before backward
        with pytest.raises(CheckpointError, match=r"checkpoint layers\.2@\d+: .*modified in place"):
            loss.backward()
    assert_nothing_installed()


def test_refusals_name_what_to_do_and_leave_the_model_as_it_was():
    model = Net()
    with pytest.raises(
        ValueError,
        match=r"select='blocks\.\*' matches no module of Net; its modules are named "
        r"like embed, layers, layers\.0",
    ):
        apply_checkpointing(model, "blocks.*")
    with pytest.raises(ValueError, match="how='everything' is not known; use 'full', 'offload'"):
        apply_checkpointing(model, how="everything")
    with pytest.raises(ValueError, match="every_n"):
        apply_checkpointing(model, every_n=0)
    with pytest.raises(TypeError, match="model must be an nn.Module, got function"):
        apply_checkpointing(lambda x: x)
    with pytest.raises(ValueError, match="no ModuleList or Sequential of repeated layers"):
        apply_checkpointing(nn.Linear(2, 2))
    apply_checkpointing(model, "layers.1")
    with pytest.raises(ValueError, match=r"layers\.1 is already checkpointed by ckptlib; call "
                                         r"ckptlib\.remove_checkpointing\(model\)"):
        apply_checkpointing(model)
    assert remove_checkpointing(model) == ["layers.1"]      # the refused call wrapped nothing
    assert all("forward" not in vars(module) for module in model.modules())


def test_under_torch_compile_it_warns_once_naming_the_graph_breaks_and_the_fullgraph_way():
    model = Net(depth=2)
    plain = step(model)
    apply_checkpointing(model)
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = compiled(*batch()).square().mean()
            loss.backward()
    messages = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert len(messages) == 1
    assert "2 checkpointed modules (layers.0, ...)" in messages[0] and "graph break" in messages[0]
    assert "fullgraph=True" in messages[0] and "torch.utils.checkpoint" in messages[0]
    assert torch.equal(loss.detach(), plain[0])
    assert all(torch.equal(p.grad, plain[1][name]) for name, p in model.named_parameters())
    remove_checkpointing(model)


# ---------------------------------------------------------------------------
# plan_checkpointing: measured bytes and FLOPs, an exact solver
# ---------------------------------------------------------------------------

from itertools import combinations   # noqa: E402

from ckptlib.model_plan import ModuleCost, _fastest_within, _peak, plan_checkpointing   # noqa: E402


def kept_after_forward(model: nn.Module, *inputs, **keyword_inputs) -> int:
    """Bytes autograd keeps for backward at the end of the forward (parameters excluded), counted
    from outside."""
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in state:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs, **keyword_inputs)
    return sum(seen.values())


def test_the_plan_predicts_exactly_what_autograd_keeps_and_fits_its_budget():
    model = Net(depth=6)
    inputs = batch()
    plain = plan_checkpointing(model, inputs, budget_bytes=10**9)
    assert plain.checkpointed == () and plain.saved_bytes == kept_after_forward(model, *inputs)
    for share in (0.8, 0.6, 0.4):
        plan = plan_checkpointing(model, inputs, budget_bytes=int(plain.saved_bytes * share))
        assert plan.peak_bytes <= plan.budget_bytes and plan.checkpointed
        with apply_checkpointing(model, plan) as handle:
            assert handle.paths == list(plan.checkpointed)
            assert plan.kept_bytes == kept_after_forward(model, *inputs)
            assert_same_step(step(Net(depth=6)), step(model))


def test_the_same_plan_on_every_run_and_a_table_that_shows_it():
    model = Net(depth=6)
    plain = plan_checkpointing(model, batch(), budget_bytes=10**9)
    plans = [
        plan_checkpointing(Net(depth=6), batch(), budget_bytes=plain.saved_bytes // 2)
        for _ in range(2)
    ]
    assert plans[0] == plans[1]
    table = str(plans[0]).splitlines()
    assert table[0].split() == [
        "module",
        "checkpointed",
        "bytes",
        "kept",
        "bytes",
        "dropped",
        "rerun",
        "FLOPs",
    ]
    assert len(table) == 1 + 6 + 1 and all(
        line.startswith(f"layers.{i} ") for i, line in enumerate(table[1:7])
    )
    assert f"budget {plain.saved_bytes // 2:,}" in table[-1]


def test_the_solver_finds_the_least_flops_that_fit_as_brute_force_does():
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = int(torch.randint(1, 7, (1,), generator=generator))
        costs = tuple(
            ModuleCost(
                f"m{i}",
                int(torch.randint(1, 50, (1,), generator=generator)),
                0,
                int(torch.randint(1, 50, (1,), generator=generator)),
            )
            for i in range(n)
        )
        saved = sum(c.dropped_bytes for c in costs) + 20
        budget = int(torch.randint(20, saved + 5, (1,), generator=generator))
        fitting = [
            subset
            for k in range(n + 1)
            for subset in combinations(costs, k)
            if (_peak(saved, [c.dropped_bytes for c in subset]) if subset else saved) <= budget
        ]
        try:
            chosen = _fastest_within(costs, saved, budget)
        except ValueError:
            assert not fitting
            continue
        least = min(sum(c.rerun_flops for c in subset) for subset in fitting)
        assert sum(c.rerun_flops for c in costs if c.path in chosen) == least


def test_a_budget_no_plan_fits_names_the_least_one():
    model = Net()
    with pytest.raises(
        ValueError,
        match=r"no choice of the 4 candidate modules keeps the activations within "
        r"1,000 bytes: plain autograd keeps [\d,]+, and checkpointing every "
        r"candidate still [\d,]+\. Raise budget_bytes",
    ):
        plan_checkpointing(model, batch(), budget_bytes=1000)
    assert_nothing_installed()


def test_checkpoint_sequential_passes_the_layers_keyword_arguments_and_refuses_a_non_dict():
    from ckptlib.sequential import checkpoint_sequential

    model = Net()
    x, mask = batch()
    expected = x.clone().requires_grad_()
    out = expected
    for layer in model.layers:
        out = layer(out, mask=mask, scale=0.5)
    out.sum().backward()
    got = x.clone().requires_grad_()
    checkpointed = checkpoint_sequential(
        model.layers, 2, got, layer_kwargs={"mask": mask, "scale": 0.5}
    )
    checkpointed.sum().backward()
    assert torch.equal(checkpointed, out) and torch.equal(got.grad, expected.grad)
    with pytest.raises(
        TypeError,
        match=r"layer_kwargs must be a dict of keyword arguments for every layer.*got tuple",
    ):
        checkpoint_sequential(model.layers, 2, x, layer_kwargs=(mask,))
    assert_nothing_installed()


def test_a_budget_that_is_not_a_whole_number_of_bytes_is_refused_in_words():
    with pytest.raises(TypeError, match=r"plan_checkpointing: budget_bytes must be an integer "
                                        r"number of bytes >= 0, got 1.5 \(float\)\."):
        plan_checkpointing(Net(), batch(), budget_bytes=1.5)
