"""ckptlib.schedules: plans against theory (Griewank-Walther, Chen et al.) and against brute
force."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from ckptlib.schedules import (
    Action,
    LayerCost,
    Plan,
    Segment,
    plan_for_budget,
    recursive,
    revolve,
    sqrt_n,
    uniform,
)


def griewank_walther_optimum(l: int, s: int) -> int:  # noqa: E741 (l and s: the paper's names)
    """Least advances to reverse l steps with s checkpoints: r*l - C(s+r, s+1), C(s+r, s) >= l."""
    r = 0
    while math.comb(s + r, s) < l:
        r += 1
    return r * l - math.comb(s + r, s + 1)


def all_plan_bodies(start: int, stop: int, whole_segment: bool = True) -> list[tuple]:
    """Every body over layers start..stop-1: each step records a layer or checkpoints a segment.

    A segment's body may not be that same segment again (nesting it only adds a rerun).
    """
    if start == stop:
        return [()]
    bodies = [(start, *rest) for rest in all_plan_bodies(start + 1, stop)]
    for end in range(start + 1, stop + (1 if whole_segment else 0)):
        for inner in all_plan_bodies(start, end, whole_segment=False):
            bodies += [(Segment(start, end, inner), *rest) for rest in all_plan_bodies(end, stop)]
    return bodies


def layer_order(plan: Plan, op: str, keep: bool | None = None) -> list[int]:
    """Layers in the order the plan's actions run them (backward ranges run downwards)."""
    order: list[int] = []
    for action in plan.actions:
        if action.op == op and (keep is None or action.keep == keep):
            layers = range(action.start, action.stop)
            order += reversed(layers) if op == "backward" else layers
    return order


def ready_made_plans() -> list[Plan]:
    return [
        uniform(16, 1),
        uniform(16, 3),
        uniform(10, 4),
        uniform(7, 7),
        sqrt_n(16),
        sqrt_n(23),
        recursive(16),
        recursive(13),
        revolve(16, 1),
        revolve(16, 3),
        revolve(20, 5),
        revolve(1, 1),
        plan_for_budget([(1, 2, 1.0)] * 12, 7),
        Plan([Segment(0, 3, (Segment(0, 2), 2))]),
        Plan([Segment(0, 2), Segment(2, 5, (2, 3, Segment(4, 5))), 5]),
    ]


# ---------------------------------------------------------------------------
# Revolve: Griewank & Walther's optimum, their conventions
# ---------------------------------------------------------------------------


def test_revolve_forward_steps_are_the_binomial_optimum():
    for l in range(1, 81):  # noqa: E741
        for s in range(1, 7):
            plan = revolve(l, s)
            assert plan.forward_steps == griewank_walther_optimum(l, s), (l, s)
            assert plan.forward_calls == l + plan.forward_steps
            assert plan.peak_slots == min(s, l - 1), (l, s)
            assert plan.peak_activations == plan.peak_slots + 1


def test_revolve_counts_advances_of_the_first_sweep_and_the_input_slot():
    """l=3, s=1 (only x0 stored): advance 0-1, reverse 2; advance 0, reverse 1; reverse 0."""
    plan = revolve(3, 1)
    assert plan.actions == (
        Action("store", 0, 1),
        Action("forward", 0, 2),
        Action("forward", 2, 3, keep=True),
        Action("backward", 2, 3),
        Action("forward", 0, 1),
        Action("forward", 1, 2, keep=True),
        Action("backward", 1, 2),
        Action("free", 0, 1),
        Action("forward", 0, 1, keep=True),
        Action("backward", 0, 1),
    )
    assert plan.forward_steps == 3 == griewank_walther_optimum(3, 1)
    # With l-1 slots every layer but the last is advanced over once: l-1 advances, not 0.
    assert revolve(5, 4).forward_steps == 4 == griewank_walther_optimum(5, 4)


def test_revolve_beats_the_fixed_splits_with_the_same_slots():
    for n in (16, 32, 64):
        log_plan = recursive(n)
        assert revolve(n, log_plan.peak_slots).forward_steps < log_plan.forward_steps
        assert revolve(n, log_plan.peak_slots).peak_slots <= log_plan.peak_slots


# ---------------------------------------------------------------------------
# uniform, sqrt_n, recursive against their theory
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(16, 4), (10, 3), (7, 1), (5, 5), (9, 2), (30, 7)])
def test_uniform_uses_torch_segments(n, k):
    size = n // k
    plan = uniform(n, k)
    segments = [step for step in plan.body if isinstance(step, Segment)]
    assert [(s.start, s.stop) for s in segments] == [
        (i * size, (i + 1) * size) for i in range(k - 1)
    ]
    assert [step for step in plan.body if isinstance(step, int)] == list(range((k - 1) * size, n))
    last = n - (k - 1) * size
    assert plan.forward_steps == (k - 1) * size
    assert plan.peak_slots == k - 1
    # End of forward: k-1 checkpoints and the last segment recorded; or, rerunning segment
    # k-2, its k-2 predecessors' checkpoints and its own layers.
    assert plan.peak_activations == max(k - 1 + last, k - 2 + size)


def test_sqrt_n_peak_is_about_two_sqrt_n():
    for n in range(1, 201):
        plan = sqrt_n(n)
        root = math.isqrt(n - 1) + 1  # ceil(sqrt(n))
        assert plan.peak_activations <= 2 * root - 1, n
        assert plan.peak_slots == math.ceil(n / root) - 1, n
        last = n - root * (math.ceil(n / root) - 1)
        assert plan.forward_steps == n - last, n
        if root * root == n:
            assert plan.peak_activations == 2 * root - 1
            assert plan.body == uniform(n, root).body
    small, large = sqrt_n(16).peak_activations, sqrt_n(256).peak_activations
    assert math.log(large / small) / math.log(256 / 16) <= 0.55


def test_recursive_keeps_log2_n_checkpoints_for_n_log_n_work():
    def recomputed(n: int) -> int:  # the first half is advanced over once more, at every level
        return 0 if n == 1 else (n + 1) // 2 + recomputed((n + 1) // 2) + recomputed(n // 2)

    for n in range(1, 130):
        plan = recursive(n)
        assert plan.peak_slots == n.bit_length() - 1, n  # floor(log2 n)
        assert plan.peak_activations == plan.peak_slots + 1, n
        assert plan.forward_steps == recomputed(n), n
    for k in range(1, 9):
        assert recursive(2**k).forward_steps == 2 ** (k - 1) * k  # (n/2) log2 n


def test_plain_and_fully_checkpointed_extremes():
    plain = uniform(12, 1)
    assert plain.body == tuple(range(12))
    assert (plain.forward_steps, plain.peak_slots, plain.peak_activations) == (0, 0, 12)
    every_layer = uniform(12, 12)
    assert (every_layer.forward_steps, every_layer.peak_slots, every_layer.peak_activations) == (
        11,
        11,
        12,
    )


# ---------------------------------------------------------------------------
# Actions: what the nested checkpoints do, checked for consistency on every plan
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("plan", ready_made_plans(), ids=lambda plan: plan.name)
def test_actions_record_and_reverse_every_layer_once(plan):
    assert sorted(layer_order(plan, "forward", keep=True)) == list(range(plan.n))
    assert layer_order(plan, "backward") == list(range(plan.n))[::-1]
    assert plan.forward_steps == len(layer_order(plan, "forward", keep=False))
    assert plan.forward_calls == plan.n + plan.forward_steps == len(layer_order(plan, "forward"))
    held: set[int] = set()
    for action in plan.actions:  # a checkpoint is stored once, then freed once
        if action.op == "store":
            assert action.start not in held
            held.add(action.start)
        elif action.op == "free":
            held.remove(action.start)
    assert not held
    # Every layer is reversed after it was recorded, and recorded after its checkpoint came back.
    for layer in range(plan.n):
        recorded_at = next(
            i
            for i, a in enumerate(plan.actions)
            if a.op == "forward" and a.keep and a.start <= layer < a.stop
        )
        reversed_at = next(
            i
            for i, a in enumerate(plan.actions)
            if a.op == "backward" and a.start <= layer < a.stop
        )
        assert recorded_at < reversed_at


def test_a_rerun_stops_at_the_input_of_a_trailing_segment():
    # The rerun of [0, 3) ends where Segment(2, 3) saves its input: layer 2 is not advanced over.
    plan = Plan([Segment(0, 3, (0, 1, Segment(2, 3))), 3])
    assert layer_order(plan, "forward") == [0, 1, 2, 3, 0, 1, 2]
    assert plan.forward_steps == 3


def test_costs_generalise_the_unit_counts():
    for plan in ready_made_plans():
        units = [LayerCost(1, 1, 1.0)] * plan.n
        assert plan.peak_bytes(units) == plan.peak_activations
        assert plan.forward_s(units) == plan.forward_calls
    costs = [LayerCost(10, 30, 2.0), LayerCost(20, 50, 1.0), LayerCost(5, 5, 0.5)]
    plan = Plan([Segment(0, 2), 2])
    # End of forward: checkpoint x0 (10) and layer 2 recorded (5); rerun: layers 0 and 1 (30 + 50).
    assert plan.peak_bytes(costs) == 80
    assert plan.forward_s(costs) == 3.5 + 3.0


def test_bad_costs_are_rejected():
    with pytest.raises(ValueError, match="has 2 records, but the plan has 3 layers"):
        uniform(3, 1).peak_bytes([(1, 1, 1.0)] * 2)
    with pytest.raises(
        TypeError, match="one \\(input_bytes, saved_bytes, forward_s\\) record per layer"
    ):
        uniform(2, 1).peak_bytes([(1, 1), (1, 1)])
    with pytest.raises(ValueError, match=r"layer_costs\[1\]"):
        uniform(2, 1).forward_s([(1, 1, 1.0), (1, -1, 1.0)])


# ---------------------------------------------------------------------------
# plan_for_budget: optimal among all plans (brute force), errors
# ---------------------------------------------------------------------------


def test_plan_for_budget_is_the_fastest_plan_that_fits():
    generator = random.Random(7)
    for n in (1, 2, 3, 4, 5):
        plans = [Plan(body) for body in all_plan_bodies(0, n)]
        for _ in range(4):
            costs = [
                LayerCost(
                    generator.randint(1, 4),
                    generator.randint(1, 8),
                    generator.choice([0.5, 1.0, 3.0]),
                )
                for _ in range(n)
            ]
            peaks = [plan.peak_bytes(costs) for plan in plans]
            for budget in sorted(set(peaks)):
                best = min(
                    plan.forward_s(costs) for plan, peak in zip(plans, peaks) if peak <= budget
                )
                chosen = plan_for_budget(costs, budget)
                assert chosen.peak_bytes(costs) <= budget
                assert chosen.forward_s(costs) == pytest.approx(best), (n, costs, budget)


def test_plan_for_budget_extremes_and_revolve():
    costs = [LayerCost(1, 1, 1.0)] * 24
    assert plan_for_budget(costs, 24).body == tuple(range(24))  # everything fits: plain autograd
    for slots in (1, 2, 3, 5):
        # Revolve keeps `slots` checkpoints plus one recorded layer; the DP may also record more.
        chosen = plan_for_budget(costs, slots + 1)
        assert chosen.peak_activations <= slots + 1
        assert chosen.forward_steps <= revolve(24, slots).forward_steps
    steps = [plan_for_budget(costs, budget).forward_steps for budget in range(2, 25)]
    assert steps == sorted(steps, reverse=True)  # more memory never costs time


def test_plan_for_budget_fits_when_sizes_need_rounding():
    generator = random.Random(3)
    costs = [
        LayerCost(1000 + generator.randint(0, 999), 3001 + generator.randint(0, 9999), 1.0)
        for _ in range(20)
    ]
    for budget in (4_000.5, 25_000, 60_000, 250_000):
        try:
            plan = plan_for_budget(costs, budget)
        except ValueError:
            continue
        assert plan.peak_bytes(costs) <= budget
    # At exactly the least memory any plan needs, rounding on the grid would find nothing.
    with pytest.raises(ValueError) as error:
        plan_for_budget(costs, 1)
    needed = int(str(error.value).split("keeps is ")[1].split(" bytes")[0])
    assert plan_for_budget(costs, needed).peak_bytes(costs) == needed


def test_plan_for_budget_names_the_least_memory_needed():
    costs = [(100, 300, 1.0), (100, 200, 1.0), (50, 400, 1.0)]
    with pytest.raises(
        ValueError, match="within 450 bytes: the least any plan keeps is 500 bytes"
    ) as error:
        plan_for_budget(costs, 450)
    assert "Raise memory_budget to at least 500" in str(error.value)
    assert plan_for_budget(costs, 500).peak_bytes(costs) == 500
    with pytest.raises(ValueError, match="memory_budget must be a finite number of bytes >= 0"):
        plan_for_budget(costs, -1)
    with pytest.raises(ValueError, match="layer_costs is empty"):
        plan_for_budget([], 100)


# ---------------------------------------------------------------------------
# Building plans by hand, bad arguments
# ---------------------------------------------------------------------------


def test_hand_made_plans_must_cover_the_layers_in_order():
    assert Plan([Segment(0, 2), Segment(2, 4, (Segment(2, 3), 3)), 4]).n == 5
    with pytest.raises(ValueError, match="expected layer 1 next, got 2"):
        Plan([0, 2])
    with pytest.raises(ValueError, match="expected layer 2 next, got 1"):
        Plan([Segment(0, 2), 1])
    with pytest.raises(ValueError, match=r"Segment\(0, 3\): steps cover layers 0\.\.1"):
        Plan([Segment(0, 3, (0, 1)), 3])
    with pytest.raises(TypeError, match="a layer index \\(int\\) or a Segment, got '1'"):
        Plan([0, "1"])
    with pytest.raises(ValueError, match="at least one step"):
        Plan([])
    with pytest.raises(ValueError, match="need 0 <= start < stop"):
        Segment(3, 3)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: uniform(4, 5), "cannot cut 4 layers into 5 segments"),
        (lambda: uniform(4, 0), "k \\(the number of segments\\) must be an integer >= 1"),
        (lambda: uniform(0, 1), "n \\(the number of layers\\) must be an integer >= 1, got 0"),
        (
            lambda: revolve(8, 0),
            "slots \\(checkpoints, x0 included\\) must be an integer >= 1, got 0",
        ),
    ],
)
def test_constructors_reject_bad_sizes(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---------------------------------------------------------------------------
# Drawings
# ---------------------------------------------------------------------------


def test_text_drawing_shows_the_state_after_each_action():
    text = str(revolve(6, 2)).splitlines()
    assert text[0] == (
        "revolve(6, slots=2): 6 layers, forward_steps=8 (forward_calls=14), "
        "peak_slots=2, peak_activations=3"
    )
    assert text[1] == "  012345"
    assert text[2] == "  o.....  store x0"
    assert text[-1] == "  <.....  backward 0"
    assert "  #.....  free x0 / forward 0, record" in text


def test_plot_draws_every_step_and_checkpoint():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = revolve(10, 3)
    figure, ax = plt.subplots()
    assert plan.plot(ax) is ax
    moves = [a for a in plan.actions if a.op in ("forward", "backward")]
    assert len(ax.lines) == len(moves)
    assert len(ax.collections) == sum(a.op == "store" for a in plan.actions)
    assert ax.lines[-1].get_xdata()[-1] == sum(a.stop - a.start for a in moves)
    plt.close(figure)


def test_importing_schedules_does_not_import_matplotlib():
    code = "import sys, ckptlib.schedules; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
