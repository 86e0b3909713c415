"""The self-checks of notebooks 06 and 07 reject the plausible wrong answers and accept the
solutions.

A self-check that accepts a wrong answer teaches the wrong thing with a green tick. Each wrong
answer below is one a learner wrote and an earlier self-check passed: a plan written out for
8 blocks, a policy that keeps only ``aten.addmm`` (every Linear in the blocks has a bias, so
``aten.mm`` was never tried), offload hooks that never put a tensor back on its device, and a
"Find it" without any check. The self-check cells are taken from the notebook by nbgrader grade
id and run in the setup of the solutions notebook (its cells before the first exercise); the
answers are the notebook's stub, the wrong answers here, and the solutions notebook's own cell.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch

from tests._notebooks import cell_source, run_cell   # a cell by grade id; exec it

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NB06 = NOTEBOOKS / "06_transformer_in_practice.ipynb"
NB07 = NOTEBOOKS / "07_beyond.ipynb"


def solutions(notebook: Path) -> Path:
    return NOTEBOOKS / "solutions" / f"{notebook.stem}_solutions.ipynb"


def setup_namespace(notebook: Path) -> dict:
    """The solutions notebook's code cells before its first exercise, run in a fresh namespace."""
    namespace: dict = {"__name__": f"notebook_{notebook.stem[:2]}"}
    for cell in nbformat.read(solutions(notebook), as_version=4).cells:
        if "exercise" in cell.metadata.get("tags", []):
            break
        if cell.cell_type == "code":
            run_cell(cell.source, namespace)
    return namespace


@pytest.fixture(scope="module")
def nb06() -> dict:
    return setup_namespace(NB06)


@pytest.fixture(scope="module")
def nb07():
    namespace = setup_namespace(NB07)
    yield namespace
    namespace["explorer"].close()


def check(namespace: dict, notebook: Path, grade_id: str, answer: str | dict) -> str:
    """Run the notebook's self-check for ``grade_id`` after ``answer`` (a cell's source, or names
    to set)."""
    namespace = dict(namespace)
    if isinstance(answer, str):
        run_cell(answer, namespace)
    else:
        namespace.update(answer)
    return run_cell(cell_source(notebook, grade_id=f"{grade_id}-check"), namespace)


# (namespace fixture, notebook, grade id, what the self-check prints for the solution)
EXERCISES = [
    ("nb06", NB06, "exercise-2", "Exercise 2 solved: right at depths 1, 2, 5 and 8"),
    (
        "nb07",
        NB07,
        "exercise-1",
        "rows [5, 7, 9]: keep 96.00 KiB, the rerun computes 5 calls\nFound: 3 calls fewer",
    ),
    (
        "nb07",
        NB07,
        "exercise-2",
        "Exercise 1 solved: keeping the linear outputs (576.00 KiB, with a bias or without)",
    ),
    ("nb07", NB07, "exercise-3", "Exercise 2 solved: a GPU tensor goes to the CPU and back"),
]
EXERCISE_IDS = [f"{notebook.stem[:2]}-{grade_id}" for _, notebook, grade_id, _ in EXERCISES]


@pytest.mark.parametrize("fixture, notebook, grade_id, solved", EXERCISES, ids=EXERCISE_IDS)
def test_the_self_check_is_the_same_in_the_solutions(fixture, notebook, grade_id, solved):
    check_id = f"{grade_id}-check"
    assert cell_source(notebook, grade_id=check_id) == cell_source(
        solutions(notebook), grade_id=check_id
    )


@pytest.mark.parametrize("fixture, notebook, grade_id, solved", EXERCISES, ids=EXERCISE_IDS)
def test_the_self_check_accepts_the_solution_and_waits_for_the_stub(
    request, fixture, notebook, grade_id, solved
):
    namespace = request.getfixturevalue(fixture)
    printed = check(
        namespace, notebook, grade_id, cell_source(solutions(notebook), grade_id=grade_id)
    )
    assert printed.startswith(solved), printed
    assert (
        check(namespace, notebook, grade_id, cell_source(notebook, grade_id=grade_id))
        == "not attempted yet\n"
    )


# ---------------------------------------------------------------- 06, Exercise 2: every other block

def written_for_8_blocks(depth):
    from ckptlib.schedules import Plan, Segment
    return Plan((Segment(0, 1), 1, Segment(2, 3), 3, Segment(4, 5), 5, Segment(6, 7), 7))


def odd_blocks_checkpointed(depth):
    from ckptlib.schedules import Plan, Segment
    return Plan(tuple(Segment(i, i + 1) if i % 2 else i for i in range(depth)))


@pytest.mark.parametrize("answer, words", [
    (written_for_8_blocks, r"every_other_block\(1\) plans 8 blocks: build the steps from `depth`"),
    (odd_blocks_checkpointed, r"every_other_block\(1\): steps should be \[Segment\(start=0"),
], ids=["written for 8 blocks", "odd blocks checkpointed"])
def test_06_exercise_2_rejects(nb06, answer, words):
    with pytest.raises(AssertionError, match=words):
        check(nb06, NB06, "exercise-2", {"every_other_block": answer})



# ----------------------------------------------------- 07, Find it: fewer calls for half the bytes


def rows_of(explorer, *ops) -> list[int]:
    return [index for index, row in enumerate(explorer.rows) if row["op"] in ops]


@pytest.mark.parametrize(
    "rows, words",
    [
        (
            lambda explorer: rows_of(explorer, "_softmax"),
            "the rerun computes 9 calls: fewer than save_matmuls' 8",
        ),
        (
            lambda explorer: rows_of(explorer, "addmm", "bmm"),
            "keeps 224.00 KiB: at most 112.00 KiB, half of save_matmuls",
        ),
        (lambda explorer: [], "the rerun computes 13 calls"),
        (lambda explorer: [len(explorer.rows)], "my_rows: row numbers from 0 to"),
    ],
    ids=["the softmax alone", "save_matmuls' rows", "nothing", "a row that is not there"],
)
def test_07_find_it_rejects(nb07, rows, words):
    with pytest.raises(AssertionError, match=words):
        check(nb07, NB07, "exercise-1", {"my_rows": rows(nb07["explorer"])})



# ---------------------------------------------------------- 07, Exercise 1: keep the linear layers

aten = torch.ops.aten


@pytest.mark.parametrize(
    "policy, words",
    [
        (
            lambda op, *args, **kwargs: op is aten.addmm.default,
            "a Linear without bias: kept 0 bytes",
        ),
        (
            lambda op, *args, **kwargs: op in (aten.mm, aten.addmm),
            "kept 0 bytes more than full checkpointing",
        ),
        (
            lambda op, *args, **kwargs: op.overloadpacket in (aten.mm, aten.addmm, aten.bmm),
            "kept 917504 bytes more than full checkpointing; the linear outputs are 589824",
        ),
    ],
    ids=["addmm only", "overload packets compared with overloads", "the attention bmm too"],
)
def test_07_exercise_1_rejects(nb07, policy, words):
    with pytest.raises(AssertionError, match=words):
        check(nb07, NB07, "exercise-2", {"save_linear_layers": policy})



# ------------------------------------------------ 07, Exercise 2: a save_on_cpu that does not leak


def to_cpu_detached(tensor):
    return tensor.detach().cpu()


def as_it_is(packed):
    return packed


def cpu_with_device(tensor):
    return (
        tensor.device,
        tensor.cpu(),
    )  # save_on_cpu's way: on a CPU, the tensor itself, grad_fn and all


def back_to_device(packed):
    device, tensor = packed
    return tensor.to(device)


@pytest.mark.parametrize(
    "pack, unpack, words",
    [
        (to_cpu_detached, as_it_is, "unpack gives backward a tensor on cpu, saved from cuda:0"),
        (
            torch.Tensor.detach,
            as_it_is,
            r"pack keeps a cuda:0 tensor on \['cuda:0'\]: copy it to the CPU",
        ),
        (cpu_with_device, back_to_device, "3 of 3 dropped graphs are still alive"),
    ],
    ids=["detach().cpu(), unpack as it is", "detach only", "save_on_cpu's leak"],
)
def test_07_exercise_2_rejects(nb07, pack, unpack, words):
    with pytest.raises(AssertionError, match=words):
        check(nb07, NB07, "exercise-3", {"pack_to_cpu": pack, "unpack_from_cpu": unpack})
