"""The interleaved timing loop: one group's variants measured for peak memory, then timed round
by round.

Design notes
============

Memory: one training step of each variant under ``ckptlib.memory.MemoryMeter``,
after a warm-up step, with the gradients set to ``None`` first so every variant
allocates them inside the step. On CUDA that is the caching allocator
(``max_memory_allocated``); elsewhere the live-tensor meter, which is exact, so
one step is enough. On CUDA the live-tensor meter also measures the same steps
and the two are compared (``meter_agreement``).

Time: ``rounds`` interleaved rounds. In each round every variant of the group
runs one step, in an order rotated by one each round, so slow drift of the
machine (another process, thermal throttling) and "who ran just before me"
effects hit all variants alike. The median over rounds is the step time and the
interquartile range (IQR) its spread. A time *ratio* is the median of the
per-round ratios, so a slow spell cancels out of it. On CUDA each step is bracketed by
``torch.cuda.synchronize()``, so the clock sees the kernels, not their launch.

Ratios, not seconds: absolute times depend on the machine; ratios between
variants measured in the same interleaved rounds are what carry over. A ratio
``x / plain`` below 1 for memory is a saving; above 1 for time an overhead.

Busy machines. The clock is wall time by default. On a CPU shared with other
jobs, a step is preempted at random and wall time mostly measures the others;
``--clock cpu`` measures the CPU time this process used instead
(``time.process_time``), which the others change much less (through shared
caches, not by taking turns). Use it with
``--threads 1``: with more threads, CPU time also counts the pool's threads
waiting for each other, and on a busy machine they wait more than they compute.
The clock and thread count are recorded with the results.

Freed memory. On Linux, glibc's ``malloc`` hands large blocks (a 4 MiB
activation) back to the operating system when they are freed, and the next
allocation of that size takes fresh pages, which the kernel zeroes on first
touch. Checkpointing variants free and reallocate more than plain autograd, so
with the default settings a CPU timing partly measures page faults, and varies
with whatever freed memory a variant happens to find. ``python -m benchmarks.bench``
therefore asks glibc (``mallopt``) to keep freed memory for reuse, as jemalloc
and tcmalloc do (PyTorch's CPU performance guide recommends those allocators).
Every variant runs under the same setting, which is recorded as ``allocator``
in the results; ``--system-malloc`` leaves glibc as it is.

"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import platform
import sys
from typing import Any, Callable, Iterator

import torch

from benchmarks.bench.config import CLOCKS, Config, Group, Variant
from benchmarks.bench.progress import Ticker
from benchmarks.bench.stats import median_and_iqr, paid_interval, ratio, selective_tradeoff
from ckptlib.memory import MemoryMeter, TimelineEntry


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Keep Python's cycle collector from firing inside a timed step (as ``timeit`` does)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _timed(step: Callable[[], Any], device: torch.device, clock: Callable[[], float]) -> float:
    _synchronize(device)
    with _no_gc():
        start = clock()
        step()
        _synchronize(device)
        return clock() - start


def measure_peak(
    variant: Variant, device: torch.device, backend: str = "auto"
) -> tuple[int, list[TimelineEntry]]:
    """Peak bytes of one step, gradients allocated inside it (see "How it measures")."""
    variant.model.zero_grad(set_to_none=True)
    with MemoryMeter(device, backend=backend) as meter:
        variant.step()
    return meter.peak_bytes, meter.timeline


def run_group(
    group: Group,
    config: Config,
    device: torch.device,
    progress: Ticker,
    timelines: dict[str, list[TimelineEntry]],
) -> dict[str, Any]:
    for variant in group.variants:
        variant.step()  # warm-up: lazy initialisation, caches
        progress.tick(f"{group.name}: warm-up {variant.name}")
    peaks: dict[str, int | None] = {}
    for variant in group.variants:
        if variant.metered is not None:
            peaks[variant.name] = None
            continue
        peaks[variant.name], timeline = measure_peak(variant, device)
        timelines[f"{group.name}/{variant.name}"] = timeline
        progress.tick(f"{group.name}: memory {variant.name}")
    times: dict[str, list[float]] = {variant.name: [] for variant in group.variants}
    for round_index in range(config.rounds):
        shift = round_index % len(group.variants)
        for variant in group.variants[shift:] + group.variants[:shift]:
            times[variant.name].append(_timed(variant.step, device, CLOCKS[config.clock]))
            progress.tick(f"{group.name}: round {round_index + 1} {variant.name}")
    return summarise_group(group, peaks, times)


def summarise_group(
    group: Group, peaks: dict[str, int | None], times: dict[str, list[float]]
) -> dict[str, Any]:
    """The JSON record of one group from its measurements: per variant the peak and the
    median step time with its IQR; the ratios to ``plain``; the group's pairs and trade-offs.

    Time ratios are medians of per-round ratios: the variants of one round ran
    back to back, so a slow spell of the machine cancels out of their ratio.

    >>> group = Group("g", "A group", "a model", [Variant("plain", "plain", None, None),
    ...                                           Variant("ckptlib", "ckptlib", None, None)],
    ...               pairs={"ckptlib_vs_plain": ("ckptlib", "plain")})
    >>> record = summarise_group(group, {"plain": 100, "ckptlib": 40},
    ...                          {"plain": [1.0], "ckptlib": [1.5]})
    >>> variants, pairs = record["variants"], record["pairs"]
    >>> variants["ckptlib"]["memory_vs_plain"], pairs["ckptlib_vs_plain"]["time"]
    (0.4, 1.5)
    """

    def time_ratio(numerator: str, denominator: str) -> tuple[float, float]:
        return median_and_iqr([a / b for a, b in zip(times[numerator], times[denominator])])

    variants = {}
    for variant in group.variants:
        median_s, iqr_s = median_and_iqr(times[variant.name])
        time_vs_plain, time_vs_plain_iqr = time_ratio(variant.name, "plain")
        variants[variant.name] = {
            "label": variant.label,
            "peak_bytes": peaks[variant.name],
            "median_s": median_s,
            "iqr_s": iqr_s,
            "times_s": times[variant.name],
            "memory_vs_plain": ratio(peaks[variant.name], peaks["plain"]),
            "time_vs_plain": time_vs_plain,
            "time_vs_plain_iqr": time_vs_plain_iqr,
        }
    pairs = {
        name: {
            "numerator": a,
            "denominator": b,
            "memory": ratio(variants[a]["peak_bytes"], variants[b]["peak_bytes"]),
            "time": time_ratio(a, b)[0],
        }
        for name, (a, b) in group.pairs.items()
    }
    point = {name: (v["peak_bytes"], v["time_vs_plain"]) for name, v in variants.items()}
    tradeoffs = {
        name: {
            "full": full,
            **selective_tradeoff(point["plain"], point[full], point[name]),
            "extra_time_paid_interval": paid_interval(times, name, full),
        }
        for name, full in group.tradeoffs.items()
    }
    return {
        "title": group.title,
        "model": group.model,
        "variants": variants,
        "pairs": pairs,
        "tradeoffs": tradeoffs,
        "notes": dict(group.notes),
    }


_allocator_setting = "system default"


def keep_freed_memory() -> str:
    """Ask glibc to keep freed memory for reuse instead of returning it to the OS (see "Freed
    memory" above); a no-op elsewhere. Returns what the allocator now does, for the record.
    For the benchmark process only: it changes the allocator of the whole process."""
    global _allocator_setting
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # musl and other libcs without mallopt
            return _allocator_setting
        m_trim_threshold, m_mmap_threshold = -1, -3
        if mallopt(m_mmap_threshold, 1 << 30) == 1 and mallopt(m_trim_threshold, 2**31 - 1) == 1:
            _allocator_setting = "glibc, freed memory kept for reuse (mallopt)"
    return _allocator_setting


def describe_environment(config: Config, device: torch.device) -> dict[str, Any]:
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": name,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "meter": "allocator" if device.type == "cuda" else "tensors",
        "rounds": config.rounds,
        "clock": config.clock,
        "quick": config.quick,
        "allocator": _allocator_setting,
    }
