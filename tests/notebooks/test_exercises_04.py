"""Notebook 04's exercise self-checks fail on plausible wrong answers and pass on the solution.

Exercise 1 (a BatchNorm pre-hook that survives early stop): an answer that takes back the counter
increment in every recomputation, without asking whether BatchNorm updates anything (the first
official solution), leaves ``num_batches_tracked`` at -3 after three eval-mode steps; one that asks
about train mode only fails on ``track_running_stats=False``, whose counter is ``None``. The cells are
the notebook's own, taken by cell id or nbgrader grade id and executed.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ckptlib.checkpoint import is_recomputing
from tests._notebooks import cell_source, run_cell

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NB04 = NOTEBOOKS / "04_rng_and_state.ipynb"
NB04_SOLUTIONS = NOTEBOOKS / "solutions" / "04_rng_and_state_solutions.ipynb"


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


@pytest.mark.parametrize("answer, words", [
    (without_mode_check, "eval mode: num_batches_tracked ends at -3, plain at 0"),
    (train_mode_check_only, "track_running_stats=False: the hook raised AttributeError: 'NoneType' object has no "
                            "attribute 'sub_'"),
], ids=["no train-mode check", "no track_running_stats check"])
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
