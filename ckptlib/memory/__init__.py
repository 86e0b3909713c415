"""Memory meters: how many bytes a block of code holds at its worst moment.

>>> from ckptlib.models import MLPChain
>>> model = MLPChain(depth=4, width=32)
>>> batch = model.example_batch(batch=8)
>>> report = measure(lambda: model.training_step(batch))
>>> report.peak_bytes      # 4 layers of gradients, the loss, one gradient, the seed
18948
>>> sorted({entry.phase for entry in report.timeline})
['backward', 'forward']

Read it in this order:

- :mod:`~ckptlib.memory.units`: :func:`format_bytes` and :func:`unit_for`, bytes as every
  table, report and picture of ckptlib writes them;
- :mod:`~ckptlib.memory.report`: :class:`MemoryReport` and :class:`TimelineEntry`, what a
  meter hands back, and what its numbers mean (the baseline, the peak, the phases);
- :mod:`~ckptlib.memory.meter`: :class:`MemoryMeter` and :func:`measure`, the two ways to
  count (the CUDA caching allocator, or live storages on any device), threads and nesting;
- :mod:`~ckptlib.memory.storages`: the live-storage count behind ``backend="tensors"``, each
  new storage until its weak reference says it died, and the storage resizes no op shows;
- :mod:`~ckptlib.memory.allocations`: what an aten op's schema says it may allocate, and which
  blocks of memory a tensor holds (sparse, MKL-DNN, wrapper subclasses).

The layers import downwards only: ``units`` <- ``report``; ``allocations`` <- ``storages``;
both <- ``meter``.
"""

from ckptlib.memory.meter import BACKENDS as BACKENDS
from ckptlib.memory.meter import MemoryMeter, measure
from ckptlib.memory.report import PHASES as PHASES
from ckptlib.memory.report import MemoryReport, TimelineEntry
from ckptlib.memory.units import format_bytes, unit_for

# torch's own UntypedStorage.resize_, which no meter may leave replaced (tests/_misuse.py checks).
from ckptlib.memory.storages import ORIGINAL_STORAGE_RESIZE as _ORIGINAL_STORAGE_RESIZE  # noqa: F401

__all__ = ["MemoryMeter", "MemoryReport", "TimelineEntry", "measure", "format_bytes", "unit_for"]
