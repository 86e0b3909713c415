"""What a memory meter hands back: the peak, the baseline, what is left, and one entry per op.

What the numbers mean
=====================

``baseline_bytes`` is what the meter could see as live when the block began.
For the allocator that is everything already on the device (parameters,
optimizer state, the batch). The tensor meter only knows storages it watched
being born, so a fresh meter starts at 0 (tensors made before the block are
invisible to it, parameters included); a meter entered again reports what is
still alive from its earlier blocks (say, the ``.grad`` of the last step).

``peak_bytes`` is the most memory *allocated inside the block* that was live
at one time, i.e. the peak minus ``baseline_bytes``: the cost of running the
block, which is what checkpointing changes. Each timeline entry's
``live_bytes`` uses the same zero, so ``max`` over the timeline is the peak
(on the allocator, a kernel's scratch space can add a little on top).

The timeline has one entry per aten op: its index, name, phase and live bytes
right after it. Phase is ``"backward"`` while autograd runs a backward pass
(``torch._C._current_graph_task_id() != -1``) and ``"recompute"`` while a
ckptlib checkpoint re-runs its function (``torch.utils.checkpoint``'s
recomputation shows up as ``"backward"``: torch gives no public flag for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ckptlib.memory.units import format_bytes

__all__ = ["MemoryReport", "TimelineEntry", "PHASES"]

PHASES = ("forward", "backward", "recompute")


class TimelineEntry(NamedTuple):
    """One aten op as the meter saw it: live bytes are counted from the block's baseline."""

    index: int
    op: str
    phase: str
    live_bytes: int


@dataclass(frozen=True)
class MemoryReport:
    """What a :class:`~ckptlib.memory.MemoryMeter` measured over one block (see the module notes
    for the zero)."""

    peak_bytes: int
    baseline_bytes: int
    retained_bytes: int
    backend: str
    device: str
    timeline: list[TimelineEntry] = field(repr=False)

    @property
    def peak_by_phase(self) -> dict[str, int]:
        """The highest ``live_bytes`` the timeline reached in each phase that occurred."""
        peaks: dict[str, int] = {}
        for entry in self.timeline:
            peaks[entry.phase] = max(peaks.get(entry.phase, entry.live_bytes), entry.live_bytes)
        return peaks

    def __str__(self) -> str:
        counts = {phase: 0 for phase in PHASES}
        for entry in self.timeline:
            counts[entry.phase] += 1
        ops = ", ".join(f"{count} {phase}" for phase, count in counts.items() if count)
        return (
            f"peak {format_bytes(self.peak_bytes)} above a baseline of "
            f"{format_bytes(self.baseline_bytes)}; {format_bytes(self.retained_bytes)} still live "
            f"at the end ({self.backend} meter on {self.device}; ops: {ops or 'none recorded'})"
        )
