"""A selective policy never holds more than plain autograd, and plans are found again through
Hugging Face's layers.

Peaks are measured with ``ckptlib.measure`` (the live-storage meter) over one training step,
forward and backward, against the same step with no checkpointing; gradients must be equal
bitwise. The Hugging Face models are built from small configs with random weights (nothing is
downloaded), in train mode: GPT-2's dropout is on.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import ckptlib
from ckptlib import apply_checkpointing, checkpoint
from ckptlib.selective import (
    SelectivePlans,
    megatron_attention,
    selective_checkpoint,
    selective_contexts,
)
from tests._grads import assert_same_step, seeded_step
from tests._models import hf_gpt2, hf_llama
from tests.selective.test_policies import OpCounter

aten = torch.ops.aten
VOCAB = 128


def gpt2() -> torch.nn.Module:
    return hf_gpt2(n_layer=2, vocab_size=VOCAB).train()


def llama() -> torch.nn.Module:
    return hf_llama(num_hidden_layers=2, vocab_size=VOCAB).train()


def tiny() -> torch.nn.Module:
    return ckptlib.TinyTransformer(
        depth=2, d_model=64, heads=4, seq=64, vocab=VOCAB, dropout=0.1
    ).train()


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step with the same dropout masks every time."""

    def loss() -> torch.Tensor:
        if isinstance(model, ckptlib.TinyTransformer):
            return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return seeded_step(model, loss)


def peak_and_result(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, tuple]:
    peak = ckptlib.measure(lambda: step(model, ids)).peak_bytes
    return peak, step(model, ids)


# (4, 64) and (2, 128) on GPT-2: where megatron_attention peaked at 1.09x and 1.12x plain autograd
# before it let go of the outputs the rerun replays for nothing.
@pytest.mark.parametrize(
    "make, batch, seq",
    [(gpt2, 4, 64), (gpt2, 2, 128), (llama, 4, 64), (tiny, 4, 64)],
    ids=["gpt2-4x64", "gpt2-2x128", "llama-4x64", "tiny-4x64"],
)
def test_megatron_attention_peaks_no_higher_than_plain_autograd_bitwise(make, batch, seq):
    model = make()
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    plain_peak, plain = peak_and_result(model, ids)
    with apply_checkpointing(model, how=megatron_attention):
        peak, got = peak_and_result(model, ids)
    assert peak <= plain_peak, (
        f"megatron_attention peaks at {peak} bytes, plain autograd at {plain_peak}"
    )
    assert_same_step(plain, got)


def keep_all_but_exp(op, *args, **kwargs):
    return op is not aten.exp.default


keep_all_but_exp.cap_every_op = True  # held to plain autograd, as megatron_attention is


def test_a_held_policy_lets_go_of_outputs_the_rerun_would_replay_for_nothing():
    # tanh saves its output, not its input, and the rerun replays tanh: nothing reads the mm's
    # output again. The count alone would keep it (exp's output, saved and not kept, leaves room
    # for it), beside the rebuilt saved tensors in the rerun; it is let go, and the mm skipped.
    w = torch.randn(16, 16, requires_grad=True)

    def fn(t):
        return (t.exp() @ w).tanh()

    x = torch.randn(8, 16, requires_grad=True)
    expected = torch.autograd.grad(fn(x).sum(), [x, w])
    contexts = []

    def context_fn():
        contexts.append(selective_contexts(keep_all_but_exp))
        return contexts[-1]

    with OpCounter() as counter:
        got = torch.autograd.grad(checkpoint(fn, x, context_fn=context_fn).sum(), [x, w])
    assert all(map(torch.equal, expected, got))
    assert (counter.recompute["mm"], counter.recompute["tanh"], counter.recompute["exp"]) == (
        0,
        0,
        1,
    )
    forward_mode, _ = contexts[0]
    assert (aten.mm.default, 0) in forward_mode.cache.dropped_shapes  # let go in forward


# ---------------------------------------------------------------------------
# Plans through Hugging Face: keyed on the layer and its forward, not on the partial HF makes
# per call; the warning about plans that die with their function only where they do.
# ---------------------------------------------------------------------------


def _plans_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "SelectivePlans" in str(w.message)]


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("route", ["hf_switch", "apply_checkpointing"])
def test_plans_are_found_again_per_layer_through_hugging_face(make, route):
    model = make()
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    plain = step(model, ids)
    plans = SelectivePlans()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if route == "hf_switch":
            function = functools.partial(
                selective_checkpoint, policy=megatron_attention, plans=plans
            )
            model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)
            results = [step(model, ids) for _ in range(3)]
            held = len(plans)
            model.activation_checkpointing_disable()
        else:
            with apply_checkpointing(model, how=megatron_attention, plans=plans):
                results = [step(model, ids) for _ in range(3)]
                held = len(plans)  # (the plans follow the wrapped forwards, gone after the block)
    assert (held, plans.recorded, plans.reused, plans.fallbacks, plans.mismatches) == (
        2,
        2,
        4,
        0,
        0,
    )
    assert not _plans_warnings(caught)
    for got in results:
        assert_same_step(plain, got)


def test_plans_made_useless_by_a_function_per_call_are_named_once_through_hugging_face():
    model = gpt2()
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    plain = step(model, ids)
    plans = SelectivePlans()

    def checkpoint_a_new_function(layer_call, *args):
        # A new lambda per call (not HF's partial, which plans see through): its plan dies with it.
        return selective_checkpoint(
            lambda *inputs: layer_call(*inputs), *args, policy=megatron_attention, plans=plans
        )

    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=checkpoint_a_new_function
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [step(model, ids) for _ in range(3)]
    model.activation_checkpointing_disable()
    messages = _plans_warnings(caught)
    assert (plans.recorded, plans.reused) == (6, 0)
    assert len(messages) == 1 and "calls recorded a plan and none reused one" in messages[0]
    assert "a new object at every call" in messages[0]
    for got in results:
        assert_same_step(plain, got)
