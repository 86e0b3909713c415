"""Notebook 04, RNG and state: the claims its prose makes, and its exercise self-checks.

Each test names the notebook section whose words it checks; when one fails, the notebook's text
(or a title computed from the same numbers) needs another look, not only the code.

Exercise 1 (torch's checkpoint made to rerun from the forward's state with a ``context_fn``): an
answer that only puts the buffers back after the recomputation (section 5's ``buffers_put_back``)
fixes the statistics but not spectral norm's gradients; one that copies the buffers when the
recomputation starts copies the updated ones; one that puts the forward's copies in but does not
put back what was there leaves the first micro-batch's statistics after two forward passes. The
cells are the notebook's own, taken by cell id or nbgrader grade id and executed.
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
from ckptlib import CheckpointError

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


def stateful_step(wrap):
    """One step of 04's model (a spectral-normalised Linear, then a BatchNorm): the BatchNorm, the
    gradients, every buffer, and the warnings' categories."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)),
                          nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    torch.manual_seed(0)
    inputs = torch.randn(16, 8) + 3.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrap(model, inputs).square().sum().backward()
    return (model[1], [p.grad for p in model.parameters()], list(model.buffers()),
            [warning.category for warning in caught])


def test_04_torch_updates_the_statistics_twice_and_ckptlib_once_bitwise():
    """04 section 5: 0.9 * (0.1 m) + 0.1 m = 0.19 m: torch's checkpoint leaves 1.9 times plain's
    running mean and counter 2, silently; ckptlib's buffers are plain's bitwise, counter 1, and
    nothing is warned."""
    plain_bn, plain_grads, plain_buffers, plain_warned = stateful_step(lambda m, x: m(x))
    torch_bn, _, torch_buffers, torch_warned = stateful_step(
        lambda m, x: torch_checkpoint(m, x, use_reentrant=False))
    bn, grads, buffers, warned = stateful_step(ckptlib.checkpoint)
    assert (plain_bn.num_batches_tracked.item(), torch_bn.num_batches_tracked.item()) == (1, 2)
    ratio = torch_bn.running_mean / plain_bn.running_mean
    assert torch.allclose(ratio, torch.full_like(ratio, 1.9), rtol=1e-4)
    assert plain_warned == torch_warned == warned == []
    assert bn.num_batches_tracked.item() == 1
    assert_bitwise_equal(buffers, plain_buffers)
    assert_bitwise_equal(grads, plain_grads)


def test_04_spectral_norm_gradients_differ_under_torch_and_not_under_ckptlib():
    """04 section 5: torch's rerun runs the power iteration from the updated u, v."""
    _, plain_grads, _, _ = stateful_step(lambda m, x: m(x))
    _, torch_grads, _, _ = stateful_step(lambda m, x: torch_checkpoint(m, x, use_reentrant=False))
    _, grads, _, _ = stateful_step(ckptlib.checkpoint)
    assert not all(torch.equal(g, r) for g, r in zip(torch_grads, plain_grads))
    assert_bitwise_equal(grads, plain_grads)


def test_04_putting_the_buffers_back_fixes_torchs_statistics_not_its_gradients():
    """04 section 5: buffers_put_back as torch's recompute context."""
    namespace = namespace_04()
    for cell_id in ("04-039",):
        run_cell(cell_source(NB04, cell_id=cell_id), namespace)
    reference = namespace["train_steps"](namespace["make_model"](), namespace["plain"], steps=3)
    result = namespace["train_steps"](namespace["make_model"](),
                                      namespace["put_back_after_rerun"], steps=3)
    assert_bitwise_equal(result["buffers"], reference["buffers"])
    assert not all(torch.equal(g, r) for g, r in zip(result["grads"], reference["grads"]))


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
    """The notebook's imports, helpers, its model with state, train_steps and two_micro_batches."""
    namespace: dict = {"__name__": "notebook_04"}
    for cell_id in ("04-001", "04-002", "04-028", "04-048"):
        run_cell(cell_source(NB04, cell_id=cell_id), namespace)
    return namespace


def run_check_1(namespace: dict) -> str:
    return run_cell(cell_source(NB04, grade_id="exercise-1-check"), namespace)


def put_back_after_only(module):
    """Section 5's fix: the buffers put back after the recomputation, nothing put in before it."""
    buffers = list(module.buffers())

    @contextlib.contextmanager
    def recompute():
        now = [buf.clone() for buf in buffers]
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, value in zip(buffers, now):
                    buf.copy_(value)

    return lambda: (contextlib.nullcontext(), recompute())


def copied_when_the_rerun_starts(module):
    """Copies the buffers in the recomputation context: by then the forward has updated them."""
    buffers = list(module.buffers())

    @contextlib.contextmanager
    def recompute():
        found = [buf.clone() for buf in buffers]
        with torch.no_grad():
            for buf, value in zip(buffers, found):
                buf.copy_(value)
        yield

    return lambda: (contextlib.nullcontext(), recompute())


def nothing_put_back(module):
    """The forward's copies put in, the rerun's result left: right for one forward per backward,
    wrong when a second forward updated the buffers before the first one's recomputation."""
    buffers = list(module.buffers())

    def context_fn():
        found = []

        @contextlib.contextmanager
        def forward():
            found[:] = [buf.clone() for buf in buffers]
            yield

        @contextlib.contextmanager
        def recompute():
            with torch.no_grad():
                for buf, value in zip(buffers, found):
                    buf.copy_(value)
            yield

        return forward(), recompute()

    return context_fn


@pytest.mark.parametrize(
    "answer, words",
    [
        (put_back_after_only, "after 3 steps the gradients differ from plain"),
        (copied_when_the_rerun_starts, "after 3 steps the gradients differ from plain"),
        (nothing_put_back, "two micro-batches: the buffers differ from plain"),
    ],
    ids=["put back only", "copied at the rerun", "nothing put back"],
)
def test_exercise_1_check_rejects_a_wrong_answer(answer, words):
    namespace = namespace_04()
    namespace["state_restoring_context_fn"] = answer
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
