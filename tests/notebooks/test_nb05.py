"""Claims notebook 05, memory vs compute, makes in prose, checked on the installed torch.

The notebooks measure these in their cells (nbval compares the committed outputs); the tests
here keep the claims true when torch or ckptlib changes, without running a notebook, and check
the few that a cell cannot show (FSDP2's parameter gathers).
"""
from __future__ import annotations

import pytest
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

import ckptlib
from ckptlib import MemoryMeter, MLPChain, measure, revolve, sqrt_n, uniform
from ckptlib.widgets import ScheduleExplorer


# ---------------------------------------------------------------------------
# Notebook 05
# ---------------------------------------------------------------------------


def _chain(n: int):
    model = MLPChain(depth=n, width=8)
    x = model.example_batch(batch=256)[0]
    model.blocks(x).sum().backward()
    return model.blocks, x


def _step(blocks, forward) -> tuple[int, int]:
    calls = []
    hooks = [
        block.register_forward_pre_hook(lambda module, args: calls.append(1)) for block in blocks
    ]
    try:
        report = measure(
            lambda: forward().sum().backward(), device="cpu", backend="tensors", timeline=False
        )
    finally:
        for hook in hooks:
            hook.remove()
    return report.peak_bytes, len(calls)


def test_each_mlp_block_keeps_one_activation_and_288_bytes_of_parameters():
    model = MLPChain(depth=4, width=8)
    x = model.example_batch(batch=256)[0]
    with MemoryMeter("cpu", backend="tensors", timeline=False) as meter:
        out = model.blocks(x)
        kept = meter.live_bytes
    assert kept == 4 * (4 * 8 * 256)
    assert sum(p.nbytes for p in model.blocks[0].parameters()) == 288
    del out


@pytest.mark.parametrize("n, segments", [(6, 3), (16, 4), (10, 3)])
def test_torch_checkpoint_sequential_is_uniform(n, segments):
    blocks, x = _chain(n)
    theirs = _step(
        blocks, lambda: torch_checkpoint_sequential(blocks, segments, x, use_reentrant=False)
    )
    ours = _step(blocks, lambda: ckptlib.checkpoint_sequential(blocks, uniform(n, segments), x))
    assert theirs == ours
    assert theirs[1] == uniform(n, segments).forward_calls


@pytest.mark.parametrize("n", [4, 9, 16, 25, 64])
def test_sqrt_n_never_reruns_its_last_segment(n):
    segment = int(round(n ** 0.5))
    assert sqrt_n(n).forward_calls == 2 * n - segment


def test_revolve_with_3_slots_measures_about_a_third_of_plain_at_16_blocks():
    blocks, x = _chain(16)
    revolve_peak, _ = _step(
        blocks, lambda: ckptlib.checkpoint_sequential(blocks, revolve(16, 3), x)
    )
    plain_peak, _ = _step(blocks, lambda: blocks(x))
    assert revolve(16, 3).peak_activations == 4
    assert revolve_peak // (4 * 8 * 256) == 6    # 4 kept, 2 in flight (and a few bytes of scalars)
    assert 0.3 < revolve_peak / plain_peak < 0.4


@pytest.mark.parametrize("n", [4, 8, 20, 33])
def test_revolve_gets_under_2n_forward_calls_only_with_every_input_stored(n):
    under_2n = [slots for slots in range(1, n) if revolve(n, slots).forward_calls < 2 * n]
    assert under_2n == [n - 1] and revolve(n, n - 1).forward_calls == 2 * n - 1


def test_on_the_explorers_chain_revolve_under_2n_peaks_like_plain_and_sqrt_n_far_below():
    explorer = ScheduleExplorer(n=20, schedule="revolve")
    try:
        peaks = {name: explorer.measure_plan(explorer.plan_for(name, 20, parameter))[0]
                 for name, parameter in (("none", None), ("revolve", 19), ("sqrt(n)", None))}
    finally:
        explorer.close()
    assert peaks["revolve"] == peaks["none"]
    assert peaks["sqrt(n)"] < peaks["none"] * 0.6
    assert sqrt_n(20).forward_calls < 2 * 20
