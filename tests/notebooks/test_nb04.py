"""Notebook 04, RNG and state: the claims its prose makes, and its exercise self-checks.

Each test names the notebook section whose words it checks; when one fails, the notebook's text
(or a title computed from the same numbers) needs another look, not only the code.

Exercise 1 (a BatchNorm pre-hook that survives early stop): an answer that takes back the counter
increment in every recomputation, without asking whether BatchNorm updates anything (the first
official solution), leaves ``num_batches_tracked`` at -3 after three eval-mode steps; one that asks
about train mode only fails on ``track_running_stats=False``, whose counter is ``None``; one whose
handle takes the hook off but leaves the momentum a recomputation set to 0.0 (the second official
solution) leaves a BatchNorm that never updates again. The cells are the notebook's own, taken by
cell id or nbgrader grade id and executed.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckptlib
from ckptlib import CheckpointError, StateUpdatedTwiceWarning
from ckptlib import is_recomputing

from tests._grads import assert_bitwise_equal
from tests._notebooks import cell_source, run_cell

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NB04 = NOTEBOOKS / "04_rng_and_state.ipynb"
NB04_SOLUTIONS = NOTEBOOKS / "solutions" / "04_rng_and_state_solutions.ipynb"


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
    assert_bitwise_equal(checkpointed, plain)


def bn_step(wrap):
    """One step of 04's BatchNorm model; returns the BatchNorm and the warnings' categories."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    torch.manual_seed(0)
    inputs = torch.randn(16, 8) + 3.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrap(model, inputs).square().sum().backward()
    return model[1], [warning.category for warning in caught]


def test_04_batch_norm_in_a_checkpoint_updates_running_stats_twice_and_ckptlib_warns():
    """0.9 * (0.1 m) + 0.1 m = 0.19 m: 1.9 times plain's running mean, counter 2; ckptlib warns
    once (StateUpdatedTwiceWarning), torch's checkpoint does the same silently."""
    (plain, plain_warned), (checkpointed, warned) = (
        bn_step(lambda m, x: m(x)),
        bn_step(ckptlib.checkpoint),
    )
    assert (plain.num_batches_tracked.item(), checkpointed.num_batches_tracked.item()) == (1, 2)
    ratio = checkpointed.running_mean / plain.running_mean
    assert torch.allclose(ratio, torch.full_like(ratio, 1.9), rtol=1e-4)
    assert (plain_warned, warned) == ([], [StateUpdatedTwiceWarning])
    torch_bn, torch_warned = bn_step(lambda m, x: torch_checkpoint(m, x, use_reentrant=False))
    assert torch_bn.num_batches_tracked.item() == 2 and torch_warned == []


def test_04_a_context_fn_that_restores_the_statistics_is_not_warned_about():
    @contextlib.contextmanager
    def restored(module):
        buffers = [
            b for m in module.modules() if isinstance(m, nn.BatchNorm1d) for b in m.buffers()
        ]
        saved = [b.clone() for b in buffers]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in zip(buffers, saved):
                    buffer.copy_(value)

    bn, warned = bn_step(
        lambda m, x: ckptlib.checkpoint(
            m, x, context_fn=lambda: (contextlib.nullcontext(), restored(m))
        )
    )
    assert bn.num_batches_tracked.item() == 1 and warned == []


def test_04_eval_mode_between_forward_and_backward_is_caught_by_the_producer():
    """04 section 6: at saved tensor #2 the shapes agree (dropout's mask, then the tanh output)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Dropout(0.5), nn.Linear(64, 32))
    out = ckptlib.checkpoint(block, torch.randn(16, 32))
    block.eval()
    with pytest.raises(
        CheckpointError,
        match=r"saved tensor #2 differs.*16x64 float32 .* a constant .*"
        r"made by TanhBackward0 \(same shape, another operation\)",
    ):
        out.sum().backward()


def test_04_a_changed_scale_attribute_passes_unnoticed():
    """04 section 6 and Exercise 2: the same ops on other values: no error, a wrong gradient."""
    torch.manual_seed(0)
    linear, scale = nn.Linear(8, 8), {"value": 1.0}
    inputs = torch.randn(4, 8)
    fn = lambda t: torch.tanh(linear(t) * scale["value"])  # noqa: E731
    (reference,) = torch.autograd.grad(fn(inputs).sum(), [linear.weight])
    out = ckptlib.checkpoint(fn, inputs)
    scale["value"] = 2.0
    (grad,) = torch.autograd.grad(out.sum(), [linear.weight])
    assert not torch.equal(grad, reference)


def test_04_metadata_check_catches_a_rerun_in_another_precision():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    batch = torch.randn(8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ckptlib.checkpoint(
            mlp,
            batch,
            context_fn=lambda: (contextlib.nullcontext(), torch.autocast("cpu", enabled=False)),
        )
    with pytest.raises(CheckpointError, match=r"saved tensor #0 differs.*bfloat16.*float32"):
        torch.autograd.grad(out.float().sum(), [batch, *mlp.parameters()])


def namespace_04() -> dict:
    """The notebook's imports, helpers, BatchNorm models and train_steps."""
    namespace: dict = {"__name__": "notebook_04"}
    for cell_id in ("04-001", "04-002", "04-020", "04-030"):
        run_cell(cell_source(NB04, cell_id=cell_id), namespace)
    return namespace


def run_check_1(namespace: dict) -> str:
    return run_cell(cell_source(NB04, grade_id="exercise-1-check"), namespace)


def without_mode_check(bn):
    """The first official solution: takes the increment back in every recomputation."""
    momentum = bn.momentum

    def pre_hook(module, args):
        if is_recomputing():
            module.momentum = 0.0
            module.num_batches_tracked.sub_(1)
        else:
            module.momentum = momentum

    return bn.register_forward_pre_hook(pre_hook)


def train_mode_check_only(bn):
    momentum = bn.momentum

    def pre_hook(module, args):
        if is_recomputing() and module.training:
            module.momentum = 0.0
            module.num_batches_tracked.sub_(1)
        elif not is_recomputing():
            module.momentum = momentum

    return bn.register_forward_pre_hook(pre_hook)


def momentum_left_at_zero(bn):
    """The second official solution: right while the hook is on, but a recomputation sets the
    momentum to 0.0 and the hook's handle does not give it back, so after ``remove()`` the
    BatchNorm never updates its statistics again."""
    momentum = bn.momentum

    def pre_hook(module, args):
        if not is_recomputing():
            module.momentum = momentum
        elif module.training and module.track_running_stats:
            module.momentum = 0.0
            module.num_batches_tracked.sub_(1)

    return bn.register_forward_pre_hook(pre_hook)


@pytest.mark.parametrize(
    "answer, words",
    [
        (without_mode_check, "eval mode: num_batches_tracked ends at -3, plain at 0"),
        (
            momentum_left_at_zero,
            "after handle.remove(), bn.momentum is 0.0, not 0.1: this BatchNorm would never update "
            "its statistics again",
        ),
        (
            train_mode_check_only,
            "track_running_stats=False: the hook raised AttributeError: 'NoneType' object has no "
            "attribute 'sub_'",
        ),
    ],
    ids=["no train-mode check", "momentum not given back", "no track_running_stats check"],
)
def test_exercise_1_check_rejects_a_wrong_answer(answer, words):
    namespace = namespace_04()
    namespace["protect_running_stats"] = answer
    with pytest.raises(AssertionError) as caught:
        run_check_1(namespace)
    assert words in str(caught.value)


def test_exercise_1_check_accepts_the_solution():
    namespace = namespace_04()
    run_cell(cell_source(NB04_SOLUTIONS, grade_id="exercise-1"), namespace)
    assert run_check_1(namespace).startswith("Exercise 1 solved")


def test_exercise_1_check_waits_for_an_attempt():
    namespace = namespace_04()
    run_cell(cell_source(NB04, grade_id="exercise-1"), namespace)
    assert run_check_1(namespace) == "not attempted yet\n"
