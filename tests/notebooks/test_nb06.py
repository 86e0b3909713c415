"""Notebook 06, a Transformer in practice: the claims its prose makes, checked with ckptlib and
torch.

Each test names the notebook section whose words it checks; when one fails, the notebook's text
(or a title computed from the same numbers) needs another look, not only the code.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.flop_counter import FlopCounterMode

import ckptlib
from ckptlib import TinyTransformer
from ckptlib import is_recomputing

from tests._notebooks import step_peak


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

    hooks = [
        hook
        for block in model.blocks
        for hook in (
            block.register_forward_pre_hook(start),
            block.register_forward_hook(stop, always_call=True),
        )
    ]
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
