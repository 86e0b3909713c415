"""PolicyExplorer without a browser: tick rows, read the exact bytes kept and calls rerun."""
from __future__ import annotations

import random
import re
import statistics

import pytest

from ckptlib import save_matmuls
from ckptlib.models import MLPChain, TinyTransformer
from ckptlib.widgets import PolicyExplorer
from ckptlib.widgets.policies import TIMED_ROUNDS

BATCH, HEADS, SEQ, D_MODEL = 2, 2, 8, 16


@pytest.fixture(scope="module")
def explorer():
    model = TinyTransformer(depth=1, d_model=D_MODEL, heads=HEADS, seq=SEQ, vocab=20)
    explorer = PolicyExplorer(model, batch=BATCH)
    yield explorer
    explorer.close()


def row_of(explorer, op):
    return next(i for i, row in enumerate(explorer.rows) if row["op"] == op)


def test_rows_are_the_ops_a_selective_checkpoint_can_keep(explorer):
    ops = [row["op"] for row in explorer.rows]
    assert ops[:2] == ["native_layer_norm", "addmm"] and ops[-1] == "addmm"
    assert not {"view", "t", "transpose", "expand", "_unsafe_view", "detach"} & set(ops)
    softmax = explorer.rows[row_of(explorer, "_softmax")]
    assert softmax["output_bytes"] == BATCH * HEADS * SEQ * SEQ * 4 and softmax["calls"] == 1
    assert softmax["input_shapes"] == ((BATCH, HEADS, SEQ, SEQ),)
    # Both residual adds have one signature: one row, two calls.
    add = explorer.rows[row_of(explorer, "add")]
    assert add["calls"] == 2 and add["output_bytes"] == 2 * BATCH * SEQ * D_MODEL * 4
    assert all(row["time_s"] > 0 for row in explorer.rows)
    assert [row["save_matmuls"] for row in explorer.rows] == [row["signature"][0] in save_matmuls
                                                              for row in explorer.rows]


def test_the_references_bracket_every_selection(explorer):
    plain, full = explorer.references["plain"], explorer.references["full checkpoint"]
    assert full["kept_bytes"] == 0 and plain["rerun_ops"] == 0
    assert plain["kept_bytes"] > explorer.references["save_matmuls"]["kept_bytes"] > 0
    assert full["rerun_ops"] > explorer.references["save_matmuls"]["rerun_ops"]
    # FLOPs do not jitter: plain recomputes none, full checkpointing every matmul, save_matmuls
    # none.
    assert plain["rerun_flops"] == explorer.references["save_matmuls"]["rerun_flops"] == 0
    assert full["rerun_flops"] > 0


def test_ticking_one_op_keeps_exactly_its_output(explorer):
    explorer.select(lambda row: False)
    for index, row in enumerate(explorer.rows):
        if row["op"] == "add":
            continue   # the second add is the block's output, alive anyway
        explorer.checkboxes[index].value = True
        assert explorer.result["kept_bytes"] == row["output_bytes"], row["op"]
        assert explorer.result["kept_rows"] == [index]
        explorer.checkboxes[index].value = False
    assert explorer.result["kept_bytes"] == 0


def test_keeping_the_softmax_spares_the_ops_that_only_fed_it(explorer):
    explorer.select(lambda row: False)
    full_calls = explorer.result["rerun_ops"]
    assert full_calls == explorer.references["full checkpoint"]["rerun_ops"]
    explorer.checkboxes[row_of(explorer, "_softmax")].value = True
    # softmax is replayed; the q @ k^T, the scaling and the mask that only fed it are skipped.
    assert explorer.result["rerun_ops"] == full_calls - 4


def test_the_buttons_tick_the_ready_made_choices(explorer):
    explorer.tick_matmuls.click()
    assert [explorer.rows[i]["op"] for i in explorer.result["kept_rows"]] == \
        [row["op"] for row in explorer.rows if row["save_matmuls"]]
    assert explorer.result["kept_bytes"] == explorer.references["save_matmuls"]["kept_bytes"] == \
        sum(row["output_bytes"] for row in explorer.rows if row["save_matmuls"])
    explorer.tick_cost.click()
    assert explorer.result["kept_rows"] == [
        i for i, row in enumerate(explorer.rows) if row["cost_policy"]
    ]
    assert explorer.result["kept_bytes"] == explorer.references["cost policy"]["kept_bytes"]
    explorer.clear.click()
    assert explorer.result["kept_rows"] == [] and explorer.result["kept_bytes"] == 0


def test_the_summary_and_plot_show_all_five_variants(explorer):
    explorer.select(lambda row: row["op"] == "gelu")
    for name in ("plain", "full checkpoint", "save_matmuls", "cost policy", "your selection"):
        assert (
            f"<b>{name.replace(' ', '<br>')}</b>" in explorer.summary.value
        )  # headers break at spaces
    assert "kept for backward" in explorer.summary.value and "rerun FLOPs" in explorer.summary.value
    assert bytes(explorer.plot.value).startswith(b"\x89PNG")


def test_what_it_cannot_explore_is_a_clear_error():
    with pytest.raises(TypeError, match="PolicyExplorer needs a TinyTransformer .* got MLPChain"):
        PolicyExplorer(MLPChain(depth=2, width=4))
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        PolicyExplorer(batch=0)


def test_display_gives_the_widget_view_and_a_stable_text(explorer):
    explorer.select(lambda row: row["op"] == "gelu")
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == f"PolicyExplorer({len(explorer.rows)} op signatures, 1 kept)"


def test_the_table_numbers_each_row_as_kept_rows_does(explorer):
    # Two rows can share an op (four addmm): the number in the "#" column names a row.
    columns = 9
    cells = explorer.table.children
    assert [re.sub("<[^>]+>", "", cell.value) for cell in cells[:2]] == ["#", "keep"]
    for number, box in enumerate(explorer.checkboxes):
        assert cells[columns * (number + 1)].value == str(number)
        assert cells[columns * (number + 1) + 1] is box
    explorer.select(lambda row: row["op"] == "addmm")
    assert explorer.result["kept_rows"] == [
        i for i, row in enumerate(explorer.rows) if row["op"] == "addmm"
    ]
    assert len(explorer.result["kept_rows"]) == 4


class ScriptedTimer:
    """A stand-in for ``explorer.timer``: each variant takes the seconds we choose; notes the
    order."""

    def __init__(self, seconds: dict[str, list[float]], explorer) -> None:
        self.seconds, self.explorer, self.calls, self.busy = seconds, explorer, [], []

    def __call__(self, name, step) -> float:
        self.calls.append(name)
        self.busy.append(
            self.explorer.time_button.disabled
            and all(box.disabled for box in self.explorer.checkboxes)
        )
        queue = self.seconds[name]
        return queue.pop(0) if len(queue) > 1 else queue[0]


VARIANTS = ["plain", "full checkpoint", "save_matmuls", "cost policy", "your selection"]


def test_nothing_is_timed_until_asked_and_then_all_five_in_turns(explorer):
    explorer.select(lambda row: row["op"] == "gelu")
    assert explorer.timing == {} and "step time" not in explorer.summary.value
    assert "Press <b>time all five</b>" in explorer.note.value
    timer = explorer.timer = ScriptedTimer({name: [0.010] for name in VARIANTS}, explorer)
    try:
        timing = explorer.time_all()
    finally:
        del explorer.timer
    # A warm-up of each, then TIMED_ROUNDS rounds of one step each, the order flipping every round.
    rounds = [VARIANTS if number % 2 == 0 else VARIANTS[::-1] for number in range(TIMED_ROUNDS)]
    assert timer.calls == VARIANTS + [name for round_ in rounds for name in round_]
    assert all(timer.busy), (
        "a tick during the timing would time a selection other than the one shown"
    )
    assert not explorer.time_button.disabled and not any(
        box.disabled for box in explorer.checkboxes
    )
    assert set(timing) == set(VARIANTS) and all(
        len(times) == TIMED_ROUNDS for times in timing.values()
    )
    assert "step time" in explorer.summary.value and "vs plain" in explorer.summary.value
    assert "timed in turns" in explorer.note.value and "Press" not in explorer.note.value
    explorer.select(lambda row: False)        # a new selection: the old times no longer describe it
    assert explorer.timing == {} and "step time" not in explorer.summary.value
    assert "Press <b>time all five</b>" in explorer.note.value


@pytest.mark.parametrize("seed", range(8))
def test_full_checkpointing_never_reads_faster_than_plain_without_a_noise_note(explorer, seed):
    generator = random.Random(seed)
    explorer.timer = ScriptedTimer(
        {
            name: [generator.uniform(0.001, 0.01) for _ in range(TIMED_ROUNDS + 1)]
            for name in VARIANTS
        },
        explorer,
    )
    try:
        timing = explorer.time_all()
    finally:
        del explorer.timer
    for name in VARIANTS[1:]:
        shown = explorer._versus_plain(name)
        ratio = statistics.median(timing[name]) / statistics.median(timing["plain"])
        assert shown.startswith(f"{ratio:.2f}x")
        overlap = min(timing[name]) <= max(timing["plain"]) and min(timing["plain"]) <= max(
            timing[name]
        )
        assert ("within noise" in shown) == (ratio < 1 or overlap), (name, shown)
        assert shown in explorer.summary.value
