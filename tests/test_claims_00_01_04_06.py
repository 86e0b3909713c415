"""The claims notebooks 00, 01, 04 and 06 make in prose, checked with ckptlib and torch.

Each test names the notebook section whose words it checks; when one fails, the notebook's text
(or a title computed from the same numbers) needs another look, not only the code.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.flop_counter import FlopCounterMode

import ckptlib
from ckptlib import CheckpointError, MLPChain, TinyTransformer, measure
from ckptlib.checkpoint import is_recomputing, record_trace
from ckptlib.memory import MemoryMeter

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def step_peak(model: nn.Module, batch, mode) -> int:
    model.checkpointing = mode
    return measure(lambda: model.training_step(batch), device="cpu", backend="tensors").peak_bytes


# -- 00: the first measurement and its bar chart -------------------------------------------


def test_00_per_block_checkpoints_save_nothing_on_the_chain_and_sqrt_more_than_half():
    """00's chart title: per-block checkpoints save nothing here; sqrt(n) segments cut the peak."""
    model = MLPChain(depth=32, width=128)
    batch = model.example_batch(batch=512)
    none, block, sqrt = (step_peak(model, batch, mode) for mode in ("none", "block", "sqrt"))
    assert block == none  # a Linear -> ReLU block saves only what its checkpoint keeps anyway
    assert sqrt < 0.5 * none


def test_00_chart_title_is_computed_from_the_measured_peaks():
    """The title says what the bars show because it is built from them, not typed in."""
    source = next(cell.source for cell in nbformat.read(NOTEBOOKS / "00_welcome_and_setup.ipynb", 4).cells
                  if "set_title" in cell.source)
    title = source[source.index("set_title"):]
    assert "Checkpointing cuts" not in title
    assert "{share['sqrt']" in title and "block_verdict" in title


def test_region_names_are_the_function_or_module_then_a_counter():
    """00 and 04 explain region names such as ``Sequential@38``."""
    with record_trace() as trace:
        ckptlib.checkpoint(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.randn(3, 2, requires_grad=True))
    regions = {event.region for event in trace.events}
    assert len(regions) == 1 and re.fullmatch(r"Sequential@\d+", regions.pop())


# -- 01: autograd graphs ---------------------------------------------------------------------


def test_01_the_articles_grad_fn_example_records_nothing():
    assert torch.tensor(1.0).sin().grad_fn is None
    assert type(torch.tensor(1.0, requires_grad=True).sin().grad_fn).__name__ == "SinBackward0"


@pytest.mark.parametrize("retain_graph, alive_bytes", [(False, 0), (True, 1024 * 2 * 4)])
def test_01_backward_frees_saved_tensors_and_retain_graph_keeps_one_shared_tensor(retain_graph, alive_bytes):
    """tanh saves its output and pow its input: one tensor, kept once; mm's saved x is data."""
    torch.manual_seed(0)
    x_big, w = torch.randn(1024, 3), torch.randn(3, 2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    with MemoryMeter("cpu", backend="tensors") as meter:
        loss = (torch.tanh(x_big @ w + b) ** 2).mean()
        loss.backward(retain_graph=retain_graph)
    loss_and_grads = sum(t.untyped_storage().nbytes() for t in (loss, w.grad, b.grad))
    assert meter.live_bytes - loss_and_grads == alive_bytes


def test_01_backward_runs_twice_through_ops_that_save_nothing():
    a, b = torch.randn(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    total = (a + b.sum()).sum()
    total.backward()
    total.backward()
    assert a.grad.tolist() == [2.0, 2.0, 2.0]
    loss = torch.tanh(a).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_01_torchviz_walks_recursively():
    """01 section 3: make_dot, like a recursive walk, fails on a 5000-op chain."""
    make_dot = pytest.importorskip("torchviz").make_dot
    deep = torch.randn(3, requires_grad=True)
    for _ in range(5000):
        deep = deep * 1.0
    with pytest.raises(RecursionError):
        make_dot(deep)


# -- 04: RNG and state -----------------------------------------------------------------------


def dropout_block_grads(**kwargs):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Dropout(0.5), nn.Linear(64, 32))
    inputs = torch.randn(16, 32)
    results = []
    for wrap in (lambda: block(inputs), lambda: ckptlib.checkpoint(block, inputs, **kwargs)):
        torch.manual_seed(1)
        results.append(torch.autograd.grad(wrap().sum(), list(block.parameters())))
    return results


def test_04_without_rng_replay_only_the_last_bias_gradient_survives():
    plain, checkpointed = dropout_block_grads(preserve_rng_state=False)
    assert [torch.equal(g, r) for g, r in zip(checkpointed, plain)] == [False, False, False, True]
    plain, checkpointed = dropout_block_grads()
    assert all(torch.equal(g, r) for g, r in zip(checkpointed, plain))


def test_04_batch_norm_in_a_checkpoint_updates_running_stats_twice():
    """0.9 * (0.1 m) + 0.1 m = 0.19 m: 1.9 times plain's running mean, counter 2."""
    def bn_step(wrap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
        torch.manual_seed(0)
        inputs = torch.randn(16, 8) + 3.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ckptlib may warn about exactly this
            wrap(model, inputs).square().sum().backward()
        return model[1]

    plain, checkpointed = bn_step(lambda m, x: m(x)), bn_step(ckptlib.checkpoint)
    assert (plain.num_batches_tracked.item(), checkpointed.num_batches_tracked.item()) == (1, 2)
    ratio = checkpointed.running_mean / plain.running_mean
    assert torch.allclose(ratio, torch.full_like(ratio, 1.9), rtol=1e-4)


def test_04_metadata_check_catches_a_rerun_in_another_precision():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    batch = torch.randn(8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ckptlib.checkpoint(mlp, batch, context_fn=lambda: (contextlib.nullcontext(),
                                                                 torch.autocast("cpu", enabled=False)))
    with pytest.raises(CheckpointError, match=r"saved tensor #0 differs.*bfloat16.*float32"):
        torch.autograd.grad(out.float().sum(), [batch, *mlp.parameters()])


# -- 06: a Transformer in practice -------------------------------------------------------------


@pytest.fixture(scope="module")
def transformer():
    model = TinyTransformer(depth=8)
    return model, model.example_batch(batch=8)


def test_06_per_block_checkpointing_beats_the_articles_range_at_depth_8(transformer):
    model, batch = transformer
    share = step_peak(model, batch, "block") / step_peak(model, batch, "none")
    assert share < 0.5  # the article: 30-50 % less, i.e. 50-70 % of plain


def test_06_the_33_percent_bound_is_on_flops_and_early_stop_skips_each_blocks_fc2(transformer):
    model, batch = transformer
    flops = {}
    for mode in ("none", "block", "torch"):
        model.checkpointing = mode
        with FlopCounterMode(display=False) as counter:
            model.training_step(batch)
        flops[mode] = counter.get_total_flops()
    model.checkpointing = "none"
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(batch[0])
    per_module = {name: sum(by_op.values()) for name, by_op in counter.get_flop_counts().items()}
    fc2 = sum(per_module[f"TinyTransformer.blocks.{i}.fc2"] for i in range(8))
    assert 3 * counter.get_total_flops() == flops["none"]  # backward = two forwards, for matmuls
    assert flops["block"] - flops["none"] == per_module["TinyTransformer.blocks"] - fc2
    assert flops["torch"] == flops["block"]
    assert flops["block"] < 4 / 3 * flops["none"]


def test_06_rerun_clock_hooks_time_every_rerun_even_when_early_stop_ends_it(transformer):
    model, batch = transformer
    started, ended = set(), []

    def start(block, args):
        if is_recomputing():
            started.add(block)

    def stop(block, args, output):
        if is_recomputing():
            started.remove(block)
            ended.append(block)

    hooks = [hook for block in model.blocks for hook in (
        block.register_forward_pre_hook(start), block.register_forward_hook(stop, always_call=True))]
    try:
        model.checkpointing = "block"
        model.training_step(batch)
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(map(id, ended)) == sorted(map(id, model.blocks)) and not started


def test_06_torch_without_use_reentrant_is_still_reentrant_and_warns():
    layer = nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch_checkpoint(layer, torch.randn(2, 4))
    assert not out.requires_grad
    assert any("use_reentrant" in str(w.message) for w in caught)
    assert ckptlib.checkpoint(layer, torch.randn(2, 4)).requires_grad


# -- every notebook here: predict, then run ------------------------------------------------------


@pytest.mark.parametrize("name, least", [("00_welcome_and_setup", 1), ("01_autograd_graphs", 2),
                                         ("04_rng_and_state", 2), ("06_transformer_in_practice", 2)])
def test_predict_cells_follow_the_course_convention(name, least):
    cells = nbformat.read(NOTEBOOKS / f"{name}.ipynb", 4).cells
    body_end = next(i for i, cell in enumerate(cells) if "exercise" in cell.metadata.get("tags", []))
    predicts = [i for i, cell in enumerate(cells[:body_end]) if "predict" in cell.metadata.get("tags", [])]
    assert len(predicts) >= least
    names = []
    for i in predicts:
        guess = re.search(r"^(guess_\w+) = .+# your guess: change it, run this cell, then the next one$",
                          cells[i].source, re.M)
        assert guess and cells[i].source.startswith("# Predict:"), cells[i].source
        names.append(guess.group(1))
        assert f"check_prediction({guess.group(1)}," in cells[i + 1].source
    assert len(set(names)) == len(names)
