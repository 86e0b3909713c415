"""The clinic's self-checks (notebook 10) fail on each case's broken code and pass on its solution.

The solutions notebook runs once, cell by cell, in one namespace. Then, for each exercise, the
self-check cell is taken from the learner's notebook by its nbgrader grade id
(``exercise-K-check``) and run three times: with the learner's starting cell (it must say "not
attempted yet"), with each ``fixed_NAME`` the solution defines replaced by the case's
``broken_NAME`` (it must fail), and with the solution (it must say "solved").
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import nbformat
import pytest

from tests._notebooks import in_folder, run_cell

pytestmark = pytest.mark.slow   # the whole notebook, two DDP runs in fresh processes, torch.compile

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LEARNER = NOTEBOOKS / "10_clinic.ipynb"
SOLUTIONS = NOTEBOOKS / "solutions" / "10_clinic_solutions.ipynb"


def graded_cells(path: Path) -> dict[str, nbformat.NotebookNode]:
    return {cell.metadata["nbgrader"]["grade_id"]: cell
            for cell in nbformat.read(path, as_version=4).cells if "nbgrader" in cell.metadata}


@pytest.fixture(scope="module")
def solved() -> dict:
    """The namespace after every code cell of the solutions notebook ran, in order."""
    namespace: dict = {"__name__": "clinic"}
    with in_folder(SOLUTIONS.parent):   # where the notebook runs: it finds clinic_ddp.py from there
        for cell in nbformat.read(SOLUTIONS, as_version=4).cells:
            if cell.cell_type == "code":
                run_cell(cell.source, namespace, f"<solutions {cell.id}>")
    return namespace


CHECKS = sorted((grade_id for grade_id in graded_cells(LEARNER) if grade_id.endswith("-check")),
                key=lambda grade_id: int(grade_id.split("-")[1]))


def test_every_case_has_an_exercise_and_a_check():
    assert len(CHECKS) >= 10
    assert set(graded_cells(LEARNER)) == set(graded_cells(SOLUTIONS))


def fixed_names(exercise_source: str) -> list[str]:
    """The functions an exercise asks for: top-level ``def fixed_...``."""
    return [node.name for node in ast.parse(exercise_source).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("fixed_")]


@pytest.mark.parametrize("check_id", CHECKS)
def test_self_check_fails_on_the_broken_code_and_passes_on_the_solution(solved, check_id):
    exercise_id = check_id.removesuffix("-check")
    check = graded_cells(LEARNER)[check_id].source
    names = fixed_names(graded_cells(SOLUTIONS)[exercise_id].source)
    assert names, f"{exercise_id}: the solution defines no fixed_... function"

    template = dict(solved)
    run_cell(graded_cells(LEARNER)[exercise_id].source, template, f"<learner {exercise_id}>")
    assert "not attempted yet" in run_cell(check, template, f"<learner {check_id}, template>")

    broken = dict(solved)
    for name in names:
        broken[name] = solved[name.replace("fixed_", "broken_", 1)]
    with pytest.raises(Exception):   # an assertion, or the broken code's own error
        output = run_cell(check, broken, f"<learner {check_id}, broken>")
        pytest.fail(
            f"the self-check passed on the broken code: {output!r}"
        )  # not an Exception: not caught

    assert "solved" in run_cell(check, dict(solved), f"<learner {check_id}, solution>")


# Wrong answers learners wrote, each one the self-check must refuse with a message that says what
# is wrong: (the exercise's grade id, the answer's code, what the message must say).
WRONG_ANSWERS = {
    "Ex1: every other block": (
        "exercise-1",
        """
        def fixed_stack_step(model, x):
            for i, block in enumerate(model):
                x = ckptlib.checkpoint(block, x) if i % 2 == 0 else block(x)
            return x.square().mean()
        """,
        r"blocks \[1, 3, 5, 7\] ran once in the step: no checkpoint recomputes them",
    ),
    "Ex1: two halves": (
        "exercise-1",
        """
        def fixed_stack_step(model, x):
            x = ckptlib.checkpoint(model[:4], x)
            return ckptlib.checkpoint(model[4:], x).square().mean()
        """,
        r"2 recomputations of a ckptlib.checkpoint for 8 blocks: checkpoint each block in its own",
    ),
    "Ex4: set_rng_state without fork_rng": (
        "exercise-4",
        """
        class ReplayingCheckpoint(HomemadeCheckpoint):
            @staticmethod
            def forward(ctx, fn, x, *params):
                ctx.rng_state = torch.get_rng_state()
                return HomemadeCheckpoint.forward(ctx, fn, x, *params)

            @staticmethod
            def backward(ctx, grad_output):
                torch.set_rng_state(ctx.rng_state)
                return HomemadeCheckpoint.backward(ctx, grad_output)


        def fixed_guided_checkpoint(fn, x, *params):
            return ReplayingCheckpoint.apply(fn, x, *params)
        """,
        r"the caller's random stream is not where plain leaves it: something drew between forward "
        r"and backward.*torch\.random\.fork_rng",
    ),
    "Ex5: no checkpoint at all": (
        "exercise-5",
        """
        def fixed_bn_forward(model, x):
            return model(x)
        """,
        r"Linear #0, ReLU #2, Linear #3 ran once in the step: nothing is recomputed there",
    ),
    "Ex5: only the last Linear": (
        "exercise-5",
        """
        def fixed_bn_forward(model, x):
            return torch_checkpoint(model[3], model[:3](x), use_reentrant=False)
        """,
        r"Linear #0, ReLU #2 ran once in the step",
    ),
    "Ex5: ckptlib's checkpoint instead of the reporter's": (
        "exercise-5",
        """
        def fixed_bn_forward(model, x):
            return ckptlib.checkpoint(model, x)
        """,
        r"ckptlib's checkpoint ran: it restores the statistics by itself",
    ),
    "Ex6: autocast hard-coded to bfloat16": (
        "exercise-6",
        """
        def fixed_autocast_checkpoint(fn, *args):
            return homemade_checkpoint(
                fn, *args, rerun_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        """,
        r"a forward without autocast (failed in backward|: gradients differ)"
        r".*rather than assume bfloat16",
    ),
    "Ex6: enabled recorded, the dtype hard-coded": (
        "exercise-6",
        """
        def fixed_autocast_checkpoint(fn, *args):
            enabled = torch.is_autocast_enabled("cpu")
            return homemade_checkpoint(
                fn, *args,
                rerun_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled))
        """,
        r"a forward under float16 autocast (failed in backward|: gradients differ)",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_ANSWERS))
def test_self_check_fails_on_a_wrong_answer_and_says_why(solved, case):
    grade_id, answer, message = WRONG_ANSWERS[case]
    namespace = dict(solved)
    run_cell(textwrap.dedent(answer), namespace, f"<wrong answer {case}>")
    with pytest.raises(AssertionError, match=message):
        run_cell(graded_cells(LEARNER)[f"{grade_id}-check"].source, namespace, f"<check {case}>")


def test_exercise_2_the_reentrant_fix_passes_too(solved):
    """The exercise says two fixes work: the solution's second, the reentrant checkpoint on an input
    that requires grad, passes the self-check as the first does."""
    namespace = dict(solved, fixed_lora_block=solved["reentrant_lora_block"])
    printed = run_cell(graded_cells(LEARNER)["exercise-2-check"].source, namespace)
    assert printed.startswith("Exercise 2 solved"), printed
