"""The self-checks of notebooks 00 to 03, run on wrong answers learners wrote and on the solutions.

A self-check that passes a wrong answer teaches it with a green tick. Each wrong answer below is
one a learner found plausible; the self-check must fail on it with a message that says what is
wrong, pass on the official solution, and say "not attempted" for the notebook's stub.

The self-check is the notebook's own cell, found by its nbgrader grade id (``exercise-K-check``),
never a copy. It runs in a namespace set up by the solutions notebook's code cells up to the
exercise (the setup the exercises use, without other exercises), then the answer's code.
"""
from __future__ import annotations

import textwrap
from functools import lru_cache
from pathlib import Path

import nbformat
import pytest

from tests._notebooks import run_cell as run

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = {"00": "00_welcome_and_setup", "01": "01_autograd_graphs", "02": "02_saved_tensors_hooks",
         "03": "03_building_checkpoint"}


@lru_cache(maxsize=None)
def cells(number: str, solutions: bool = False) -> tuple:
    name = NAMES[number]
    path = (
        NOTEBOOKS / "solutions" / f"{name}_solutions.ipynb"
        if solutions
        else NOTEBOOKS / f"{name}.ipynb"
    )
    return tuple(nbformat.read(path, as_version=4).cells)


def grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def graded_source(number: str, grade: str, solutions: bool = False) -> str:
    found = [cell.source for cell in cells(number, solutions) if grade_id(cell) == grade]
    assert len(found) == 1, (
        f"notebook {number}: expected one cell with grade id {grade!r}, found {len(found)}"
    )
    return found[0]


def setup(number: str, exercise: str) -> dict:
    """A namespace with every code cell of the solutions notebook before ``exercise`` run in it,
    other exercises and their self-checks left out."""
    namespace: dict = {"__name__": f"notebook_{number}"}
    for cell in cells(number, solutions=True):
        if grade_id(cell) == exercise:
            return namespace
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "code" and "exercise" not in tags and "self-check" not in tags:
            run(cell.source, namespace)
    raise AssertionError(f"notebook {number} has no exercise {exercise!r}")


def self_check(number: str, exercise: str, answer: str) -> str:
    """What the notebook's self-check prints for ``answer`` (the code of an exercise cell)."""
    namespace = setup(number, exercise)
    run(answer, namespace)
    return run(graded_source(number, f"{exercise}-check"), namespace)


def solution(number: str, exercise: str) -> str:
    return graded_source(number, exercise, solutions=True)


def solution_with(number: str, exercise: str, *changes: tuple[str, str]) -> str:
    """The official solution with each ``(old, new)`` change made: a wrong answer one step from
    it."""
    source = solution(number, exercise)
    for old, new in changes:
        assert old in source, f"notebook {number} {exercise}'s solution no longer contains {old!r}"
        source = source.replace(old, new)
    return source


def stub(number: str, exercise: str) -> str:
    return graded_source(number, exercise)


EXERCISES = [
    (number, cell_grade)
    for number in NAMES
    for cell_grade in sorted({grade_id(cell) for cell in cells(number)} - {None})
    if not cell_grade.endswith("-check")
]


@pytest.mark.parametrize("number, exercise", EXERCISES)
def test_the_self_check_is_the_same_cell_in_the_solutions(number, exercise):
    assert graded_source(number, f"{exercise}-check") == graded_source(
        number, f"{exercise}-check", solutions=True
    )


@pytest.mark.parametrize("number, exercise", EXERCISES)
def test_the_solution_passes_and_the_stub_is_not_attempted(number, exercise):
    printed = self_check(number, exercise, solution(number, exercise))
    assert "correct" in printed or "solved" in printed, printed
    assert "not attempted" in self_check(number, exercise, stub(number, exercise)).lower()


def roles_by_name(output_pattern: str) -> str:
    """A 01 Ex2 answer that calls a saved tensor an output when its attribute's name matches
    ``output_pattern``, an input otherwise."""
    return f"""
import re

def saved_roles(node):
    roles = set()
    for attribute in dir(node):
        saved = getattr(node, attribute) if attribute.startswith("_saved_") else None
        if isinstance(saved, torch.Tensor):
            roles.add("output" if re.fullmatch({output_pattern!r}, attribute) else "input")
    return roles
"""


# 03 Ex3: versions kept for the tensor arguments only, then paired with every argument, so that
# in checkpoint(fn, 2.0, h) the number gets h's version and h none.
TENSOR_VERSIONS_ZIPPED_WITH_ALL_ARGUMENTS = """
class InputCheckedFrame(CheckedFrame):
    def __init__(self, fn, args):
        super().__init__(fn, args)
        self.versions = [arg._version for arg in args if isinstance(arg, torch.Tensor)]

    def rerun(self):
        for position, (arg, version) in enumerate(zip(self.args, self.versions)):
            if arg._version != version:
                raise CheckpointError(f"input #{position} was modified in place")
        super().rerun()


input_checked_checkpoint = make_checkpoint(InputCheckedFrame)
"""


# Each wrong answer: (notebook, exercise, the answer's code, what the self-check's message must
# say).
WRONG_ANSWERS = {
    "00 Ex2: one over the depth, a guess at the theory": (
        "00",
        "exercise-2",
        """
        def checkpointed_fraction(depth):
            return 1 / depth
        """,
        r"depth 4: yours 25\.0%, measured 85\.7%.*whole training step",
    ),
    "00 Ex2: the peak of the forward pass alone": (
        "00",
        "exercise-2",
        """
        def checkpointed_fraction(depth):
            model = ckptlib.MLPChain(depth=depth, width=64)
            batch = model.example_batch(batch=512)
            peaks = {}
            for mode in ("none", "sqrt"):
                model.checkpointing = mode
                peaks[mode] = ckptlib.measure(lambda: model.loss(batch)).peak_bytes
            return peaks["sqrt"] / peaks["none"]
        """,
        r"depth 4: yours 80\.0%, measured 85\.7%; depth 16: yours 47\.1%, measured 52\.6%; "
        r"depth 64: yours 24\.6%, measured 27\.0%",
    ),
    "01 Ex2: if/elif, never both roles": (
        "01",
        "exercise-2",
        """
        def saved_roles(node):
            names = [a for a in dir(node)
                     if a.startswith("_saved_") and isinstance(getattr(node, a), torch.Tensor)]
            if "_saved_result" in names:
                return {"output"}
            elif names:
                return {"input"}
            return set()
        """,
        r"s\.prod\(\) .*: yours \['output'\], saved \['input', 'output'\]",
    ),
    "01 Ex2: a lookup table by op name": (
        "01",
        "exercise-2",
        """
        ROLES = {"PowBackward0": {"input"}, "ReluBackward0": {"output"}, "MulBackward0": {"input"},
                 "ExpBackward0": {"output"}, "SinBackward0": {"input"}, "TanhBackward0": {"output"},
                 "LogBackward0": {"input"}, "ProdBackward0": {"input", "output"},
                 "FmodBackward1": {"input"}}

        def saved_roles(node):
            return ROLES.get(type(node).__name__, set())
        """,
        r"s\.fmod\(three\) .*: yours \['input'\], saved \[\]",
    ),
    "01 Ex2: only _saved_self, _saved_other and _saved_result looked at": (
        "01",
        "exercise-2",
        """
        def saved_roles(node):
            roles = set()
            for name, role in [("_saved_self", "input"), ("_saved_other", "input"),
                               ("_saved_result", "output")]:
                if isinstance(getattr(node, name, None), torch.Tensor):
                    roles.add(role)
            return roles
        """,
        r"linear\(s\[None\]\) \(AddmmBackward0\): yours \[\], saved \['input'\].*"
        r"every tensor among them counts \(a Linear keeps _saved_mat1\)",
    ),
    "01 Ex2: only _saved_result an output (layer norm's statistics, max's indices)": (
        "01",
        "exercise-2",
        roles_by_name(r"_saved_result"),
        r"layer_norm\(s\) .*: yours \['input'\], saved \['input', 'output'\]; "
        r"s\.max\(dim=0\) .*: yours \['input'\], saved \['output'\]; "
        r"s\.sort\(\): yours \['input'\], saved \['output'\]\..*_saved_result1",
    ),
    "01 Ex2: every _saved_indices an output, embedding's too": (
        "01",
        "exercise-2",
        roles_by_name(r"_saved_(result\d*|indices)"),
        r"embedding\(ids, table\): yours \['output'\], saved \['input'\].*"
        r"embedding's _saved_indices is an input$",
    ),
    "02 Ex1: a dict keyed by id(tensor)": (
        "02",
        "exercise-1",
        """
        def count_saved_bytes(fn):
            storages = {}

            def pack(tensor):
                storages[id(tensor)] = tensor.untyped_storage().nbytes()
                return tensor.detach()

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                fn()
            return sum(storages.values())
        """,
        r"differs from the hand count for: x\[:32\] \* x\[32:\]$",
    ),
    "02 Ex1: the tensor's bytes, not its storage's": (
        "02",
        "exercise-1",
        """
        def count_saved_bytes(fn):
            storages = {}

            def pack(tensor):
                nbytes = tensor.numel() * tensor.element_size()
                storages[tensor.untyped_storage().data_ptr()] = nbytes
                return tensor.detach()

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                fn()
            return sum(storages.values())
        """,
        r"differs from the hand count for: x\[:32\]\.sin\(\), x\[:32\] \* x\[32:\]$",
    ),
    "02 Ex2: a plain dict keyed by data_ptr": (
        "02",
        "exercise-2",
        solution_with(
            "02",
            "exercise-2",
            ("bf16_copies = weakref.WeakValueDictionary()", "bf16_copies = {}"),
            (
                "key = (StorageWeakRef(tensor.untyped_storage()), tensor.storage_offset(), "
                "tensor.shape, tensor.stride())",
                "key = tensor.untyped_storage().data_ptr()",
            ),
        ),
        r"after backward, with the graph gone, 8,192 B your hooks made are still alive"
        r"|gradients differ by \d+\.\d% from the exact ones: .*Key by the storage",
    ),  # a reused address
    "02 Ex2: a weak dict keyed by data_ptr alone": (
        "02",
        "exercise-2",
        solution_with(
            "02",
            "exercise-2",
            (
                "key = (StorageWeakRef(tensor.untyped_storage()), tensor.storage_offset(), "
                "tensor.shape, tensor.stride())",
                "key = tensor.data_ptr()",
            ),
        ),
        r"gradients differ by \d+\.\d% from the exact ones: .*(?i:key by the storage)",
    ),  # the MLP or h @ h.t()
    "02 Ex2: float16 instead of bfloat16": (
        "02",
        "exercise-2",
        solution_with("02", "exercise-2", ("torch.bfloat16", "torch.float16")),
        r"\(square \* 1e5\)\.pow\(2\): gradients differ by (inf|nan)% .*float16 stops at 65504",
    ),
    "03 Ex1: a slice of the optimizer's shared list": (
        "03",
        "exercise-1",
        """
        class PerBackwardHook(ForwardHook):
            def __init__(self, optimizer, forward_fn, args):
                super().__init__(optimizer, forward_fn, args)
                self.lists = {}

            def unpack(self, index):
                task = torch._C._current_graph_task_id()
                if task not in self.lists:
                    start = len(self.optimizer.recomputed_activations)
                    self._recompute_activations()
                    self.lists[task] = self.optimizer.recomputed_activations[start:]
                slots = self.lists[task]
                tensor, slots[index] = slots[index], None
                return tensor
        """,
        r"4 recomputed storages are still alive: the optimizer's shared list still holds 6 tensors",
    ),
    "03 Ex3: any version but 0 refused": (
        "03",
        "exercise-3",
        """
        class InputCheckedFrame(CheckedFrame):
            def rerun(self):
                for position, arg in enumerate(self.args):
                    if isinstance(arg, torch.Tensor) and arg._version != 0:
                        raise CheckpointError(f"input #{position} was modified in place")
                super().rerun()


        input_checked_checkpoint = make_checkpoint(InputCheckedFrame)
        """,
        r"an input modified before the call was refused .*not with 0",
    ),
    "03 Ex3: only args[0] checked": (
        "03",
        "exercise-3",
        """
        class InputCheckedFrame(CheckedFrame):
            def __init__(self, fn, args):
                super().__init__(fn, args)
                self.first_version = args[0]._version

            def rerun(self):
                if self.args[0]._version != self.first_version:
                    raise CheckpointError("input #0 was modified in place after the forward pass")
                super().rerun()


        input_checked_checkpoint = make_checkpoint(InputCheckedFrame)
        """,
        r"the second argument was modified in place .*not only the first",
    ),
    "03 Ex3: versions of the tensor arguments zipped with all the arguments": (
        "03",
        "exercise-3",
        TENSOR_VERSIONS_ZIPPED_WITH_ALL_ARGUMENTS,
        r"checkpoint\(fn, 2\.0, h\) raised AttributeError: .*Keep one version per argument",
    ),
    "03 Ex3: the same, the non-tensors skipped when comparing": (
        "03",
        "exercise-3",
        TENSOR_VERSIONS_ZIPPED_WITH_ALL_ARGUMENTS.replace(
            "if arg._version != version:",
            "if isinstance(arg, torch.Tensor) and arg._version != version:",
        ),
        r"checkpoint\(fn, 2\.0, h\): h was modified in place after forward and the rerun went "
        r"ahead",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_ANSWERS))
def test_the_self_check_fails_on_a_wrong_answer_and_says_why(case):
    number, exercise, answer, message = WRONG_ANSWERS[case]
    with pytest.raises(AssertionError, match=message):
        self_check(number, exercise, textwrap.dedent(answer))
