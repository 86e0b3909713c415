"""``python -m ckptlib.bench``: peak memory and step time of every way to checkpoint, side by side.

Every number the course quotes about checkpointing comes from this file, so a
learner can rerun it on their own machine (``make bench``, ``make figures``).

What it runs
============

Three *groups* of variants; the variants of a group train the same model (same
seed, same batch) and differ only in how activations are kept:

``blocks``     a ``TinyTransformer``: plain autograd, ``torch.utils.checkpoint``
               per block (``use_reentrant=False``), ``ckptlib.checkpoint`` per
               block, ``checkpoint_sequential`` with sqrt(n) segments; plus the
               plain step under the memory meter, to measure the meter's cost.
``selective``  4 blocks, d_model 256, seq 256, batch 4: full checkpointing
               (ckptlib and torch) and selective checkpointing that keeps the
               matmul outputs (``ckptlib.policies.save_matmuls`` and PyTorch's
               ``create_selective_checkpoint_contexts`` with the same ops),
               ckptlib's Megatron-style policy (recompute only the attention core),
               and a policy chosen from one block's measured op costs
               (``policy_from_costs``, up to half of the block's activations),
               run as is and with its plans reused (``SelectivePlans``: after the
               first call, forward runs with no dispatch mode).
``offload``    saved tensors moved to CPU: ``ckptlib.offload`` and
               ``torch.autograd.graph.save_on_cpu``.

Then two sweeps that measure memory only: peak vs depth of the Transformer per
checkpointing mode, and the *scaling run*: peak vs chain length n (16 ... 256)
of an ``MLPChain`` under plain autograd, a sqrt(n) plan and a recursive plan,
with the module forward calls counted and compared with the plan's prediction
(``plan.forward_calls``: the ``n`` first forwards plus ``plan.forward_steps``
recomputed ones).

How it measures
===============

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

The scaling run measures *activation* memory: the gradients are allocated by a
warm-up step and accumulate in place during the measured one, so the peak is
what the schedule keeps, and its growth with n is the schedule's, not the
parameters'. The exponent ``p`` of ``peak ~ c * n**p`` comes from least squares
on log-log axes; ``peak ~ a + b * log2(n)`` is fitted too, for the recursive plan.

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
with whatever freed memory a variant happens to find. ``python -m ckptlib.bench``
therefore asks glibc (``mallopt``) to keep freed memory for reuse, as jemalloc
and tcmalloc do (PyTorch's CPU performance guide recommends those allocators).
Every variant runs under the same setting, which is recorded as ``allocator``
in the results; ``--system-malloc`` leaves glibc as it is.

From Python (``tests/test_bench.py`` runs the command line at the ``TINY`` sizes)::

    bench = run(QUICK)                 # a progress bar on stderr
    print(format_report(bench.summary))
    write_figures(bench, "figures")
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence, TextIO

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ckptlib.memory import MemoryMeter, TimelineEntry, format_bytes
from ckptlib.models import MLPChain, TinyTransformer
from ckptlib.offload import offload_saved_tensors
from ckptlib.policies import (
    SelectivePlans, megatron_attention, policy_from_costs, save_matmuls, selective_checkpoint,
)
from ckptlib.schedules import Plan, recursive, sqrt_n

__all__ = [
    "Config", "TransformerSize", "DEFAULT", "QUICK", "TINY", "CLOCKS", "BenchRun", "BenchError", "Group", "Variant", "run", "main",
    "keep_freed_memory",
    "SEED_CLAIMS", "SCHEMA", "SUMMARY_KEYS",
    "ratio", "median_and_iqr", "selective_tradeoff", "fit_power_law", "fit_log",
    "summarise_group", "format_bar", "ProgressBar", "format_table", "format_report", "to_markdown", "write_markdown",
    "write_figures",
]

SCHEMA = "ckptlib.bench/1"
SUMMARY_KEYS = ("schema", "environment", "groups", "meter_overhead", "seed_claims", "depth", "scaling",
                "meter_agreement", "targets")

# The seed article's claims, quoted: the inputs the bench compares its measurements with.
SEED_CLAIMS = (
    {"claim": "30-50% less memory for 20-30% more time",
     "memory_saving": [0.30, 0.50], "time_overhead": [0.20, 0.30]},
    {"claim": "48 GB -> 28 GB (-42%) at +15% time",
     "memory_saving": [1 - 28 / 48, 1 - 28 / 48], "time_overhead": [0.15, 0.15]},
)

# PyTorch's selective checkpointing as issue 7 measured it (4 blocks, d_model 256, seq 256, CPU).
TORCH_SAC_REFERENCE = {"saving_kept": 0.36, "extra_time_paid": 0.63}


# ---------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerSize:
    """A ``TinyTransformer`` and the batch it trains on."""

    depth: int
    d_model: int
    heads: int
    seq: int
    vocab: int
    batch: int

    def build(self, device: torch.device, **overrides: Any) -> TinyTransformer:
        sizes = dict(depth=self.depth, d_model=self.d_model, heads=self.heads, seq=self.seq, vocab=self.vocab)
        return TinyTransformer(**{**sizes, **overrides}).to(device)

    def describe(self, depth: int | str | None = None) -> str:
        """``TinyTransformer(depth=8, ...), batch 8``; ``depth`` replaces the depth shown."""
        return (f"TinyTransformer(depth={self.depth if depth is None else depth}, d_model={self.d_model}, "
                f"heads={self.heads}, seq={self.seq}, vocab={self.vocab}), batch {self.batch}")


@dataclass(frozen=True)
class Config:
    """Everything that sets how long the bench runs; ``DEFAULT``, ``QUICK`` and ``TINY`` below.

    The ``blocks`` model has depth 8, not the ``TinyTransformer`` default of 4:
    per-block checkpointing still keeps one block's activations (while it is
    recomputed), the block inputs, the gradients and the un-checkpointed head, so
    the share of the peak it removes grows with depth; the depth sweep reports
    it at every depth, the default model's included.
    """

    rounds: int = 15
    blocks: TransformerSize = TransformerSize(depth=8, d_model=128, heads=4, seq=64, vocab=256, batch=8)
    selective: TransformerSize = TransformerSize(depth=4, d_model=256, heads=4, seq=256, vocab=256, batch=4)
    depths: tuple[int, ...] = (1, 2, 4, 8, 16)
    scaling_ns: tuple[int, ...] = (16, 32, 64, 128, 256)
    # Narrow and tall: activations (batch x width) dominate the weights (width x width).
    scaling_width: int = 32
    scaling_batch: int = 256
    clock: str = "wall"       # "wall" (time.perf_counter) or "cpu" (time.process_time); see "Busy machines"
    quick: bool = False


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
DEFAULT = Config()
QUICK = Config(rounds=5, depths=(1, 2, 4, 8), scaling_ns=(16, 32, 64, 128), quick=True)
TINY = Config(rounds=2, quick=True,
              blocks=TransformerSize(depth=2, d_model=16, heads=2, seq=8, vocab=32, batch=2),
              selective=TransformerSize(depth=2, d_model=16, heads=2, seq=8, vocab=32, batch=2),
              depths=(1, 2), scaling_ns=(4, 9, 16), scaling_width=4, scaling_batch=8)
"""A run of a few seconds, for tests; the numbers mean nothing at this size."""


# ---------------------------------------------------------------------------
# Pure helpers: ratios, statistics, fits
# ---------------------------------------------------------------------------


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is 0.

    >>> ratio(3.0, 4.0), ratio(1.0, 0.0), ratio(None, 2.0)
    (0.75, None, None)
    """
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def median_and_iqr(values: Sequence[float]) -> tuple[float, float]:
    """Median and interquartile range (0 for fewer than two values).

    >>> median_and_iqr([1.0, 2.0, 3.0, 4.0, 100.0])
    (3.0, 2.0)
    """
    if not values:
        raise ValueError("median_and_iqr needs at least one value.")
    if len(values) < 2:
        return float(values[0]), 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), quartiles[2] - quartiles[0]


def selective_tradeoff(plain: tuple[float, float], full: tuple[float, float],
                       selective: tuple[float, float]) -> dict[str, float | None]:
    """How much of full checkpointing's saving a selective policy keeps, and of its extra time it pays.

    Each argument is ``(peak_bytes, step_s)``. ``saving_kept`` is
    ``(plain - selective) / (plain - full)`` for memory, ``extra_time_paid`` the
    same for time with the signs of an overhead.

    >>> selective_tradeoff(plain=(100, 1.0), full=(40, 1.5), selective=(70, 1.125))
    {'saving_kept': 0.5, 'extra_time_paid': 0.25}
    """
    (plain_bytes, plain_s), (full_bytes, full_s), (sel_bytes, sel_s) = plain, full, selective
    return {"saving_kept": ratio(plain_bytes - sel_bytes, plain_bytes - full_bytes),
            "extra_time_paid": ratio(sel_s - plain_s, full_s - plain_s)}


def paid_interval(times: dict[str, list[float]], selective: str, full: str, *, resamples: int = 2000,
                  seed: int = 0) -> list[float] | None:
    """A 95% bootstrap interval for ``extra_time_paid``: the rounds resampled with replacement
    (a round's variants together, as they ran), the trade-off recomputed from the medians of
    the per-round time ratios each time. ``None`` with fewer than 5 rounds.

    The share divides two small overheads, so it is far noisier than either step time: the
    interval says how far one run's value can be trusted.

    >>> times = {"plain": [1.0, 1.1, 0.9, 1.0, 1.05], "full": [1.5, 1.6, 1.4, 1.5, 1.55],
    ...          "sel": [1.2, 1.3, 1.1, 1.2, 1.25]}
    >>> low, high = paid_interval(times, "sel", "full")
    >>> 0.3 < low <= high < 0.5
    True
    """
    rounds = len(times["plain"])
    if rounds < 5:
        return None
    ratios = {name: [a / b for a, b in zip(times[name], times["plain"])] for name in (selective, full)}
    generator = random.Random(seed)
    values = []
    for _ in range(resamples):
        picks = [generator.randrange(rounds) for _ in range(rounds)]
        full_extra = statistics.median([ratios[full][i] for i in picks]) - 1
        if full_extra > 0:
            values.append((statistics.median([ratios[selective][i] for i in picks]) - 1) / full_extra)
    if len(values) < resamples // 2:
        return None       # full checkpointing did not even cost time in most resamples
    values.sort()
    return [values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]]


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Slope, intercept and R^2 of the straight line through ``(xs, ys)``."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a fit needs two or more (x, y) pairs of equal count, got {len(xs)} and {len(ys)}.")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs at least two different x values.")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys))
    r2 = 1.0 - residual / total if total > 0 else 1.0
    return slope, intercept, r2


def fit_power_law(ns: Sequence[float], values: Sequence[float]) -> dict[str, float]:
    """Fit ``value = coefficient * n ** exponent`` by least squares on log-log axes.

    >>> fit = fit_power_law([16, 64, 256], [4 * n ** 0.5 for n in [16, 64, 256]])
    >>> round(fit["exponent"], 6), round(fit["coefficient"], 6), round(fit["r2"], 6)
    (0.5, 4.0, 1.0)
    """
    if min(ns) <= 0 or min(values) <= 0:
        raise ValueError("a power-law fit needs positive n and values (it takes logarithms).")
    slope, intercept, r2 = _least_squares([math.log(n) for n in ns], [math.log(v) for v in values])
    return {"exponent": slope, "coefficient": math.exp(intercept), "r2": r2}


def fit_log(ns: Sequence[float], values: Sequence[float]) -> dict[str, float]:
    """Fit ``value = intercept + per_doubling * log2(n)`` by least squares.

    ``per_doubling`` is what one doubling of n adds.

    >>> fit = fit_log([16, 32, 64, 128], [100 + 7 * math.log2(n) for n in [16, 32, 64, 128]])
    >>> round(fit["per_doubling"], 6), round(fit["intercept"], 6), round(fit["r2"], 6)
    (7.0, 100.0, 1.0)
    """
    if min(ns) <= 0:
        raise ValueError("a log fit needs positive n.")
    slope, intercept, r2 = _least_squares([math.log2(n) for n in ns], list(values))
    return {"per_doubling": slope, "intercept": intercept, "r2": r2}


# ---------------------------------------------------------------------------
# Progress bar and text formatting
# ---------------------------------------------------------------------------


def format_bar(done: int, total: int, label: str = "", width: int = 24, elapsed_s: float | None = None) -> str:
    """One line of a text progress bar.

    >>> format_bar(3, 12, "blocks: torch", width=8, elapsed_s=65)
    '[##------]  25%  3/12 01:05 blocks: torch'
    """
    fraction = min(max(done / total, 0.0), 1.0) if total > 0 else 1.0
    filled = int(round(fraction * width))
    line = f"[{'#' * filled}{'-' * (width - filled)}] {fraction * 100:3.0f}% {done:>{len(str(total))}}/{total}"
    if elapsed_s is not None:
        minutes, seconds = divmod(int(elapsed_s), 60)
        line += f" {minutes:02d}:{seconds:02d}"
    return f"{line} {label}".rstrip()


class ProgressBar:
    """A text progress bar on a stream (stderr by default).

    On a terminal it redraws one line; elsewhere (a CI log, a pipe) it writes a
    line every 10% so the log stays short.

    >>> import io
    >>> stream = io.StringIO()
    >>> bar = ProgressBar(4, stream=stream, width=4)
    >>> for _ in range(4):
    ...     bar.advance("step")
    >>> bar.close()
    >>> stream.getvalue().splitlines()[-1].startswith("[####] 100% 4/4")
    True
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.width, self.done = total, width, 0
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.perf_counter()
        self.last_decile = -1

    def advance(self, label: str = "", steps: int = 1) -> None:
        self.done = min(self.done + steps, self.total)
        line = format_bar(self.done, self.total, label, self.width, time.perf_counter() - self.started)
        if self.interactive:
            self.stream.write("\r" + line.ljust(100)[:100])
        else:
            decile = 10 * self.done // max(self.total, 1)
            if decile == self.last_decile:
                return
            self.last_decile = decile
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned.

    >>> print(format_table(["variant", "ratio"], [["plain", "1.00"], ["ckptlib", "0.45"]]))
    variant  ratio
    -------  -----
    plain     1.00
    ckptlib   0.45
    """
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *map(line, cells[1:])])


def _x(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value * 100:+.{digits}f}%"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f} ms"


# ---------------------------------------------------------------------------
# Variants: one training step each
# ---------------------------------------------------------------------------


@dataclass
class Variant:
    """One way to run a training step of ``model`` on ``batch``.

    ``context`` wraps the step (offload hooks); ``metered`` runs the step under
    the live-tensor meter and is timed only (the meter's own cost).
    """

    name: str
    label: str
    model: MLPChain | TinyTransformer
    batch: tuple[torch.Tensor, torch.Tensor]
    context: Callable[[], ContextManager] = contextlib.nullcontext
    metered: str | None = None   # None, "peak" or "timeline"

    def step(self) -> None:
        if self.metered is None:
            self._train()
            return
        with MemoryMeter(self.model.device, backend="tensors", timeline=self.metered == "timeline"):
            self._train()

    def _train(self) -> None:
        with self.context():
            self.model.training_step(self.batch)


@dataclass
class Group:
    """Variants measured together: interleaved in time, compared with the one named ``plain``."""

    name: str
    title: str
    model: str
    variants: list[Variant]
    pairs: dict[str, tuple[str, str]] = field(default_factory=dict)   # name -> (numerator, denominator)
    tradeoffs: dict[str, str] = field(default_factory=dict)           # selective variant -> its full variant
    notes: dict[str, str] = field(default_factory=dict)               # what else a reader needs (a policy's choice)


class _RunWith(nn.Module):
    """A block run through ``runner(block, x)``: how the bench applies a checkpoint the
    models' ``checkpointing`` switch does not offer (selective policies)."""

    def __init__(self, block: nn.Module, runner: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.block, self.runner = block, runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner(self.block, x)


def _with_runner(model: TinyTransformer, runner: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> TinyTransformer:
    model.blocks = nn.Sequential(*(_RunWith(block, runner) for block in model.blocks))
    return model


def _ckptlib_selective(policy: Any, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return selective_checkpoint(block, x, policy=policy)


def _ckptlib_selective_reusing_plans(policy: Any, plans: SelectivePlans, block: nn.Module,
                                     x: torch.Tensor) -> torch.Tensor:
    return selective_checkpoint(block, x, policy=policy, plans=plans)


def _torch_selective(ops: list, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    context_fn = partial(create_selective_checkpoint_contexts, ops)
    return torch_checkpoint(block, x, use_reentrant=False, context_fn=context_fn)


def _cost_policy(size: TransformerSize, device: torch.device) -> Any:
    """A policy chosen from one block's measured op costs: cache at most half of its activations.
    (Medians of 9 timed runs: with the default 3, a noisy machine sometimes picks another set.)"""
    model = size.build(device)
    x = torch.randn(size.batch, size.seq, size.d_model, device=device, requires_grad=True)
    return policy_from_costs(model.blocks[0], x, memory_ratio=0.5, repeats=9)


def _torch_save_on_cpu(device: torch.device) -> ContextManager:
    # pin_memory makes the device-to-host copies asynchronous, as ckptlib.offload does on CUDA.
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def _groups(config: Config, device: torch.device) -> list[Group]:
    size = config.blocks
    plain = size.build(device)
    batch = plain.example_batch(batch=size.batch)
    blocks = Group("blocks", "Per-block checkpointing", size.describe(), [
        Variant("plain", "plain autograd", plain, batch),
        Variant("torch", "torch.utils.checkpoint per block", size.build(device, checkpointing="torch"), batch),
        Variant("ckptlib", "ckptlib.checkpoint per block", size.build(device, checkpointing="block"), batch),
        Variant("sqrt", "checkpoint_sequential, sqrt(n) segments", size.build(device, checkpointing="sqrt"), batch),
        Variant("plain_metered", "plain, under the live-tensor meter", plain, batch, metered="peak"),
        Variant("plain_metered_timeline", "plain, meter recording a timeline", plain, batch, metered="timeline"),
    ], pairs={"ckptlib_vs_torch": ("ckptlib", "torch")})

    size = config.selective
    plain = size.build(device)
    batch = plain.example_batch(batch=size.batch)
    cost_policy = _cost_policy(size, device)
    selective = Group("selective", "Selective checkpointing", size.describe(), [
        Variant("plain", "plain autograd", plain, batch),
        Variant("torch", "torch.utils.checkpoint per block", size.build(device, checkpointing="torch"), batch),
        Variant("ckptlib", "ckptlib.checkpoint per block", size.build(device, checkpointing="block"), batch),
        Variant("torch_save_matmuls", "torch SAC, save matmuls",
                _with_runner(size.build(device), partial(_torch_selective, list(save_matmuls))), batch),
        Variant("ckptlib_save_matmuls", "ckptlib selective, save matmuls",
                _with_runner(size.build(device), partial(_ckptlib_selective, save_matmuls)), batch),
        Variant("ckptlib_megatron", "ckptlib selective, Megatron attention",
                _with_runner(size.build(device), partial(_ckptlib_selective, megatron_attention)), batch),
        Variant("ckptlib_cost_policy", "ckptlib selective, policy from measured op costs",
                _with_runner(size.build(device), partial(_ckptlib_selective, cost_policy)), batch),
        Variant("ckptlib_cost_policy_plans", "ckptlib selective, that policy, plans reused (SelectivePlans)",
                _with_runner(size.build(device), partial(_ckptlib_selective_reusing_plans, cost_policy,
                                                         SelectivePlans())), batch),
    ], pairs={"ckptlib_vs_torch": ("ckptlib", "torch"),
              "ckptlib_vs_torch_save_matmuls": ("ckptlib_save_matmuls", "torch_save_matmuls")},
        tradeoffs={"torch_save_matmuls": "torch", "ckptlib_save_matmuls": "ckptlib",
                   "ckptlib_megatron": "ckptlib", "ckptlib_cost_policy": "ckptlib",
                   "ckptlib_cost_policy_plans": "ckptlib"},
        notes={"cost policy keeps": ", ".join(f"`{call}`" for call in sorted(map(str, cost_policy.chosen)))
               + f" ({format_bytes(cost_policy.used_bytes)} per block)"})

    size = config.blocks
    plain = size.build(device)
    batch = plain.example_batch(batch=size.batch)
    offload = Group("offload", "Offloading saved tensors to CPU", size.describe(), [
        Variant("plain", "plain autograd", plain, batch),
        Variant("torch_save_on_cpu", "torch.autograd.graph.save_on_cpu", size.build(device), batch,
                context=partial(_torch_save_on_cpu, device)),
        Variant("ckptlib_offload", "ckptlib.offload.offload_saved_tensors", size.build(device), batch,
                context=offload_saved_tensors),
    ], pairs={"ckptlib_vs_torch": ("ckptlib_offload", "torch_save_on_cpu")})
    return [blocks, selective, offload]


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


class _Progress:
    """The bar, or nothing: lets the measuring code call ``tick`` unconditionally."""

    def __init__(self, bar: ProgressBar | None) -> None:
        self.bar = bar

    def tick(self, label: str) -> None:
        if self.bar is not None:
            self.bar.advance(label)


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


def _peak(variant: Variant, device: torch.device, backend: str = "auto") -> tuple[int, list[TimelineEntry]]:
    """Peak bytes of one step, gradients allocated inside it (see "How it measures")."""
    variant.model.zero_grad(set_to_none=True)
    with MemoryMeter(device, backend=backend) as meter:
        variant.step()
    return meter.peak_bytes, meter.timeline


def _run_group(group: Group, config: Config, device: torch.device, progress: _Progress,
               timelines: dict[str, list[TimelineEntry]]) -> dict[str, Any]:
    for variant in group.variants:
        variant.step()                                   # warm-up: lazy initialisation, caches
        progress.tick(f"{group.name}: warm-up {variant.name}")
    peaks: dict[str, int | None] = {}
    for variant in group.variants:
        if variant.metered is not None:
            peaks[variant.name] = None
            continue
        peaks[variant.name], timeline = _peak(variant, device)
        timelines[f"{group.name}/{variant.name}"] = timeline
        progress.tick(f"{group.name}: memory {variant.name}")
    times: dict[str, list[float]] = {variant.name: [] for variant in group.variants}
    for round_index in range(config.rounds):
        shift = round_index % len(group.variants)
        for variant in group.variants[shift:] + group.variants[:shift]:
            times[variant.name].append(_timed(variant.step, device, CLOCKS[config.clock]))
            progress.tick(f"{group.name}: round {round_index + 1} {variant.name}")
    return summarise_group(group, peaks, times)


def summarise_group(group: Group, peaks: dict[str, int | None], times: dict[str, list[float]]) -> dict[str, Any]:
    """The JSON record of one group from its measurements: per variant the peak and the
    median step time with its IQR; the ratios to ``plain``; the group's pairs and trade-offs.

    Time ratios are medians of per-round ratios: the variants of one round ran
    back to back, so a slow spell of the machine cancels out of their ratio.

    >>> group = Group("g", "A group", "a model", [Variant("plain", "plain", None, None),
    ...                                           Variant("ckptlib", "ckptlib", None, None)],
    ...               pairs={"ckptlib_vs_plain": ("ckptlib", "plain")})
    >>> record = summarise_group(group, {"plain": 100, "ckptlib": 40}, {"plain": [1.0], "ckptlib": [1.5]})
    >>> record["variants"]["ckptlib"]["memory_vs_plain"], record["pairs"]["ckptlib_vs_plain"]["time"]
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
    pairs = {name: {"numerator": a, "denominator": b,
                    "memory": ratio(variants[a]["peak_bytes"], variants[b]["peak_bytes"]),
                    "time": time_ratio(a, b)[0]}
             for name, (a, b) in group.pairs.items()}
    point = {name: (v["peak_bytes"], v["time_vs_plain"]) for name, v in variants.items()}
    tradeoffs = {name: {"full": full, **selective_tradeoff(point["plain"], point[full], point[name]),
                        "extra_time_paid_interval": paid_interval(times, name, full)}
                 for name, full in group.tradeoffs.items()}
    return {"title": group.title, "model": group.model, "variants": variants, "pairs": pairs,
            "tradeoffs": tradeoffs, "notes": dict(group.notes)}


def _run_depths(config: Config, device: torch.device, progress: _Progress) -> dict[str, Any]:
    modes = {"plain": "none", "torch": "torch", "ckptlib": "block", "sqrt": "sqrt"}
    peaks: dict[str, list[int]] = {name: [] for name in modes}
    size = config.blocks
    for depth in config.depths:
        for name, mode in modes.items():
            model = size.build(device, depth=depth, checkpointing=mode)
            variant = Variant(name, name, model, model.example_batch(batch=size.batch))
            variant.step()
            peaks[name].append(_peak(variant, device)[0])
            progress.tick(f"depth {depth}: {name}")
    return {"model": size.describe(depth="d"), "depths": list(config.depths),
            "peak_bytes": peaks,
            "saving_vs_plain": {name: [1 - p / q for p, q in zip(values, peaks["plain"])]
                                for name, values in peaks.items() if name != "plain"}}


class _ForwardCounter:
    """Counts forward calls of each block (first run and recomputations alike)."""

    def __init__(self, blocks: nn.Sequential) -> None:
        self.calls = 0
        self.handles = [block.register_forward_pre_hook(self._count) for block in blocks]

    def _count(self, module: nn.Module, args: Any) -> None:
        self.calls += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _scaling_plans(n: int) -> dict[str, Plan | str]:
    return {"plain": "none", "sqrt": sqrt_n(n), "recursive": recursive(n)}


def _run_scaling(config: Config, device: torch.device, progress: _Progress) -> dict[str, Any]:
    modes: dict[str, dict[str, list]] = {}
    for n in config.scaling_ns:
        for name, plan in _scaling_plans(n).items():
            model = MLPChain(depth=n, width=config.scaling_width, checkpointing=plan).to(device)
            batch = model.example_batch(batch=config.scaling_batch)
            model.loss(batch).backward()        # allocates the .grad tensors the measured step accumulates into
            counter = _ForwardCounter(model.blocks)
            with MemoryMeter(device, timeline=False) as meter:
                model.loss(batch).backward()
            counter.remove()
            record = modes.setdefault(name, {key: [] for key in (
                "peak_bytes", "forward_calls", "plan_forward_calls", "plan_forward_steps", "plan_peak_activations")})
            record["peak_bytes"].append(meter.peak_bytes)
            record["forward_calls"].append(counter.calls)
            # Plain autograd as a plan: n forwards, nothing recomputed, every activation kept.
            record["plan_forward_calls"].append(n if isinstance(plan, str) else plan.forward_calls)
            record["plan_forward_steps"].append(0 if isinstance(plan, str) else plan.forward_steps)
            record["plan_peak_activations"].append(n if isinstance(plan, str) else plan.peak_activations)
            progress.tick(f"scaling n={n}: {name}")
    for record in modes.values():
        record["power_fit"] = fit_power_law(config.scaling_ns, record["peak_bytes"])
        record["log_fit"] = fit_log(config.scaling_ns, record["peak_bytes"])
    return {"model": f"MLPChain(depth=n, width={config.scaling_width}), batch {config.scaling_batch}",
            "activation_bytes_per_layer": 4 * config.scaling_width * config.scaling_batch,
            "ns": list(config.scaling_ns), "modes": modes}


def _run_meter_agreement(groups: list[Group], device: torch.device, progress: _Progress) -> dict[str, Any]:
    """CUDA only: the allocator and the live-tensor meter on the same steps."""
    rows = {}
    for group in groups[:2]:
        for variant in group.variants:
            if variant.metered is not None:
                continue
            allocator_bytes = _peak(variant, device, backend="allocator")[0]
            tensors_bytes = _peak(variant, device, backend="tensors")[0]
            rows[f"{group.name}/{variant.name}"] = {
                "allocator_bytes": allocator_bytes, "tensors_bytes": tensors_bytes,
                "relative_difference": ratio(tensors_bytes - allocator_bytes, allocator_bytes)}
            progress.tick(f"meter agreement: {group.name}/{variant.name}")
    worst = max((abs(row["relative_difference"] or 0.0) for row in rows.values()), default=None)
    return {"variants": rows, "worst_relative_difference": worst}


def _work_units(config: Config, groups: list[Group], device: torch.device) -> int:
    units = 0
    for group in groups:
        variants = len(group.variants)
        units += variants * (2 + config.rounds) - sum(v.metered is not None for v in group.variants)
    units += len(config.depths) * 4 + len(config.scaling_ns) * 3
    if device.type == "cuda":
        units += sum(v.metered is None for group in groups[:2] for v in group.variants)
    return units


# ---------------------------------------------------------------------------
# The whole run
# ---------------------------------------------------------------------------


@dataclass
class BenchRun:
    """What one run measured: ``summary`` is the JSON document; ``timelines`` (per op, for the
    timeline figure) stay in memory, ``"group/variant" -> list of TimelineEntry``."""

    summary: dict[str, Any]
    timelines: dict[str, list[TimelineEntry]]


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
        except (OSError, AttributeError):   # musl and other libcs without mallopt
            return _allocator_setting
        m_trim_threshold, m_mmap_threshold = -1, -3
        if mallopt(m_mmap_threshold, 1 << 30) == 1 and mallopt(m_trim_threshold, 2**31 - 1) == 1:
            _allocator_setting = "glibc, freed memory kept for reuse (mallopt)"
    return _allocator_setting


def _environment(config: Config, device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "device": str(device), "device_name": name, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "meter": "allocator" if device.type == "cuda" else "tensors",
            "rounds": config.rounds, "clock": config.clock, "quick": config.quick,
            "allocator": _allocator_setting}


def run(config: Config = DEFAULT, device: torch.device | str = "cpu",
        progress: ProgressBar | None | str = "auto") -> BenchRun:
    """Run every group and sweep once; ``progress="auto"`` draws a bar on stderr, ``None`` none.

    Returns the JSON summary (see ``SUMMARY_KEYS``) and the per-op timelines.
    """
    device = torch.device(device)
    _check_device(device, config.clock)
    if device.type == "cuda":
        torch.cuda.init()   # before any checkpoint: its RNG state must exist to be saved
    groups = _groups(config, device)
    bar = ProgressBar(_work_units(config, groups, device)) if progress == "auto" else progress
    ticker = _Progress(bar if isinstance(bar, ProgressBar) else None)
    timelines: dict[str, list[TimelineEntry]] = {}
    try:
        results = {group.name: _run_group(group, config, device, ticker, timelines) for group in groups}
        depth = _run_depths(config, device, ticker)
        scaling = _run_scaling(config, device, ticker)
        agreement = _run_meter_agreement(groups, device, ticker) if device.type == "cuda" else None
    finally:
        if isinstance(bar, ProgressBar):
            bar.close()
    results["selective"]["tradeoffs"]["torch_save_matmuls"]["issue_7_measured"] = dict(TORCH_SAC_REFERENCE)
    blocks = results["blocks"]["variants"]
    summary = {
        "schema": SCHEMA,
        "environment": _environment(config, device),
        "groups": results,
        "meter_overhead": {"peak": blocks["plain_metered"]["time_vs_plain"],
                           "timeline": blocks["plain_metered_timeline"]["time_vs_plain"]},
        "seed_claims": _seed_claims(results),
        "depth": depth,
        "scaling": scaling,
        "meter_agreement": agreement,
    }
    summary["targets"] = _targets(summary)
    return BenchRun(summary, timelines)


def _claim_rows(claims: dict[str, Any], quote: str) -> list[list[str]]:
    """Rows of the claims-vs-measured table: the seed article's claims, then our variants."""
    rows = [[f"claim: {c['claim']}", _span(c["memory_saving"], "-"), _span(c["time_overhead"], "+")]
            for c in claims["claims"]]
    rows += [[f"measured: {quote}{m['variant']}{quote}", _pct(-m["memory_saving"]), _pct(m["time_overhead"])]
             for m in claims["measured"]]
    return rows


def _seed_claims(results: dict[str, Any]) -> dict[str, Any]:
    measured = []
    for group, name in (("blocks", "ckptlib"), ("blocks", "torch"), ("blocks", "sqrt"),
                        ("selective", "ckptlib"), ("selective", "ckptlib_save_matmuls"),
                        ("selective", "ckptlib_megatron"), ("selective", "ckptlib_cost_policy"),
                        ("selective", "ckptlib_cost_policy_plans")):
        variant = results[group]["variants"][name]
        measured.append({"variant": f"{group}/{name}", "label": variant["label"],
                         "memory_saving": 1 - variant["memory_vs_plain"],
                         "time_overhead": variant["time_vs_plain"] - 1})
    return {"claims": [dict(claim) for claim in SEED_CLAIMS], "measured": measured}


def _target(name: str, source: str, value: float | None, op: str, threshold: float,
            interval: Sequence[float] | None = None) -> dict[str, Any]:
    met = None if value is None else (value <= threshold if op == "<=" else value >= threshold)
    target = {"name": name, "source": source, "value": value, "op": op, "threshold": threshold, "met": met}
    if interval is not None:
        target["interval"] = list(interval)
    return target


def _targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    groups, scaling = summary["groups"], summary["scaling"]["modes"]
    blocks = groups["blocks"]
    targets = [
        _target("ckptlib/torch peak memory, per block", "issue 3",
                blocks["pairs"]["ckptlib_vs_torch"]["memory"], "<=", 1.0),
        _target("ckptlib/torch step time, per block", "issue 3", blocks["pairs"]["ckptlib_vs_torch"]["time"], "<=", 1.0),
        _target("per-block checkpointing: share of the plain peak saved", "issue 3",
                1 - blocks["variants"]["ckptlib"]["memory_vs_plain"], ">=", 0.60),
        _target("live-tensor meter: metered/unmetered step time", "issue 3",
                summary["meter_overhead"]["peak"], "<=", 1.5),
    ]
    for name in ("ckptlib_save_matmuls", "ckptlib_megatron", "ckptlib_cost_policy", "ckptlib_cost_policy_plans",
                 "torch_save_matmuls"):
        tradeoff = groups["selective"]["tradeoffs"][name]
        targets += [
            _target(f"{name}: share of full checkpointing's saving kept", "issue 7", tradeoff["saving_kept"], ">=", 0.5),
            _target(f"{name}: share of full checkpointing's extra time paid", "issue 7",
                    tradeoff["extra_time_paid"], "<=", 0.5, interval=tradeoff.get("extra_time_paid_interval")),
        ]
    mismatches = sum(_forward_mismatches(record) for record in scaling.values())
    targets += [
        _target("sqrt(n) plan: exponent of peak vs n", "issue 7", scaling["sqrt"]["power_fit"]["exponent"], "<=", 0.55),
        # "grows like log n": a straight line against log2(n) explains the peaks.
        _target("recursive plan: R^2 of peak vs log2(n)", "issue 7 (threshold set here)",
                scaling["recursive"]["log_fit"]["r2"], ">=", 0.95),
        _target("scaling runs whose forward calls differ from the plan's", "issue 7", mismatches, "<=", 0),
    ]
    if summary["meter_agreement"] is not None:
        targets.append(_target("|live-tensor meter / allocator - 1|, worst variant", "issue 3",
                               summary["meter_agreement"]["worst_relative_difference"], "<=", 0.02))
    return targets


def _forward_mismatches(record: dict[str, list[int]]) -> int:
    return sum(counted != planned for counted, planned in zip(record["forward_calls"], record["plan_forward_calls"]))


class BenchError(Exception):
    """The bench cannot run as asked (no CUDA, a clock that cannot time the device ...)."""


def _check_device(device: torch.device, clock: str) -> None:
    if device.type not in ("cpu", "cuda"):
        raise BenchError(f"--device {device}: the bench measures on 'cpu' or 'cuda'.")
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise BenchError(f"--device cuda: no CUDA device is available ({build}). Run on a machine with an "
                         "NVIDIA GPU and a CUDA build of torch, or leave out --device cuda to measure on CPU.")
    if clock == "cpu":
        raise BenchError("--clock cpu counts host CPU time, not the GPU's: use the wall clock with "
                         "--device cuda (the bench synchronises around each step).")


# ---------------------------------------------------------------------------
# Reports: text table, Markdown, JSON
# ---------------------------------------------------------------------------


def format_report(summary: dict[str, Any]) -> str:
    """The stdout report: one table per group, the claims, the sweeps and the targets."""
    env = summary["environment"]
    parts = [f"ckptlib.bench on {env['device']} ({env['device_name']}), torch {env['torch']}, "
             f"{_threads(env)}, {env['rounds']} interleaved rounds, {env['clock']} clock; "
             f"memory: {env['meter']} meter"]
    for group in summary["groups"].values():
        rows = [[name, format_bytes(v["peak_bytes"]) if v["peak_bytes"] is not None else "-",
                 _x(v["memory_vs_plain"]), _ms(v["median_s"]), _ms(v["iqr_s"]), _x(v["time_vs_plain"]),
                 _x(v["time_vs_plain_iqr"])] for name, v in group["variants"].items()]
        parts.append(f"\n{group['title']}: {group['model']}\n" + format_table(
            ["variant", "peak", "mem/plain", "median step", "IQR", "time/plain", "IQR"], rows))
        for name, pair in group["pairs"].items():
            parts.append(f"{pair['numerator']} / {pair['denominator']}: memory {_x(pair['memory'])}, "
                         f"time {_x(pair['time'])}")
        for name, tradeoff in group["tradeoffs"].items():
            parts.append(f"{name}: keeps {_x(tradeoff['saving_kept'])} of {tradeoff['full']}'s saving, "
                         f"pays {_x(tradeoff['extra_time_paid'])} of its extra time" + _reference(tradeoff))
    overhead = summary["meter_overhead"]
    parts.append(f"\nLive-tensor meter: step time x{_x(overhead['peak'])} (peak only), "
                 f"x{_x(overhead['timeline'])} (recording a timeline)")
    parts.append("\nThe seed article's claims next to ours (change vs plain)\n"
                 + format_table(["", "peak memory", "step time"], _claim_rows(summary["seed_claims"], quote="")))
    depth = summary["depth"]
    rows = [[d] + [format_bytes(depth["peak_bytes"][name][i]) for name in depth["peak_bytes"]]
            + [_pct(depth["saving_vs_plain"]["ckptlib"][i])] for i, d in enumerate(depth["depths"])]
    parts.append(f"\nPeak vs depth: {depth['model']}\n"
                 + format_table(["depth", *depth["peak_bytes"], "ckptlib saving"], rows))
    scaling = summary["scaling"]
    rows = [[n] + [f"{format_bytes(r['peak_bytes'][i])} {r['forward_calls'][i]}/{r['plan_forward_calls'][i]}"
                   for r in scaling["modes"].values()] for i, n in enumerate(scaling["ns"])]
    rows.append(["n^p fit"] + [f"p={r['power_fit']['exponent']:.2f} R2={r['power_fit']['r2']:.3f}"
                               for r in scaling["modes"].values()])
    rows.append(["log2 n fit"] + [f"{format_bytes(r['log_fit']['per_doubling'])}/x2 R2={r['log_fit']['r2']:.3f}"
                                  for r in scaling["modes"].values()])
    parts.append(f"\nScaling: {scaling['model']}; peak, forward calls counted/planned\n"
                 + format_table(["n", *scaling["modes"]], rows))
    if summary["meter_agreement"] is not None:
        rows = [[name, format_bytes(r["allocator_bytes"]), format_bytes(r["tensors_bytes"]),
                 _pct(r["relative_difference"], 2)] for name, r in summary["meter_agreement"]["variants"].items()]
        parts.append("\nMeters on the same steps\n" + format_table(["variant", "allocator", "live tensors", "diff"], rows))
    parts.append("\nTargets\n" + _targets_table(summary["targets"]))
    return "\n".join(parts)


def _threads(environment: dict[str, Any]) -> str:
    threads = environment["threads"]
    return f"{threads} CPU thread{'s' if threads != 1 else ''}"


def _interval(bounds: Sequence[float] | None) -> str:
    return "" if bounds is None else f" (95% interval {_x(bounds[0])} to {_x(bounds[1])})"


def _reference(tradeoff: dict[str, Any]) -> str:
    reference = tradeoff.get("issue_7_measured")
    if reference is None:
        return ""
    return f" (issue 7 measured {reference['saving_kept']:.2f} and {reference['extra_time_paid']:.2f})"


def _span(bounds: Sequence[float], sign: str) -> str:
    """``[0.3, 0.5]`` with sign ``-`` -> ``-30..50%``: a claimed range of changes."""
    low, high = bounds
    return f"{sign}{low * 100:.0f}%" if low == high else f"{sign}{low * 100:.0f}..{high * 100:.0f}%"


def _measured(target: dict[str, Any]) -> str:
    """A target's measured value, with its 95% interval where it has one."""
    value = target["value"]
    text = _x(value, 3) if isinstance(value, float) else str(value)
    return text + (f" ({_x(target['interval'][0])} to {_x(target['interval'][1])})" if "interval" in target else "")


def _targets_table(targets: list[dict[str, Any]]) -> str:
    rows = [[t["name"], _measured(t),
             f"{t['op']} {t['threshold']}", {True: "met", False: "MISSED", None: "n/a"}[t["met"]], t["source"]]
            for t in targets]
    return format_table(["target", "measured", "goal", "", "from"], rows)


def _markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] * len(headers)) + "|"]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_markdown(summary: dict[str, Any]) -> str:
    """The results as Markdown tables of ratios (absolute times only mean something per machine)."""
    env = summary["environment"]
    parts = [f"Measured on {env['device']} ({env['device_name']}), torch {env['torch']}, {_threads(env)}, "
             f"{env['rounds']} interleaved rounds, {env['clock']} clock, `{env['meter']}` memory meter"
             + (" (`--quick`)" if env["quick"] else "") + "."]
    for group in summary["groups"].values():
        rows = [[f"`{name}`", v["label"], _x(v["memory_vs_plain"]), _x(v["time_vs_plain"]), _x(v["time_vs_plain_iqr"])]
                for name, v in group["variants"].items()]
        parts.append(f"**{group['title']}**: {group['model']}\n\n" + _markdown_table(
            ["variant", "what", "peak / plain", "step time / plain", "its IQR"], rows))
        lines = [f"- `{p['numerator']}` / `{p['denominator']}`: memory {_x(p['memory'])}, time {_x(p['time'])}"
                 for p in group["pairs"].values()]
        lines += [f"- `{name}` keeps {_x(t['saving_kept'])} of `{t['full']}`'s memory saving and pays "
                  f"{_x(t['extra_time_paid'])}{_interval(t.get('extra_time_paid_interval'))} of its extra time"
                  + _reference(t) for name, t in group["tradeoffs"].items()]
        lines += [f"- {what}: {note}" for what, note in group.get("notes", {}).items()]
        parts.append("\n".join(lines))
    parts.append("**The seed article's claims next to ours** (change vs plain)\n\n"
                 + _markdown_table(["", "peak memory", "step time"], _claim_rows(summary["seed_claims"], quote="`")))
    overhead = summary["meter_overhead"]
    parts.append(f"**Live-tensor meter**: the plain step takes x{_x(overhead['peak'])} as long under the meter "
                 f"(peak only), x{_x(overhead['timeline'])} recording a timeline.")
    depth = summary["depth"]
    rows = [[d] + [_x(depth["peak_bytes"][name][i] / depth["peak_bytes"]["plain"][i]) for name in depth["peak_bytes"]]
            for i, d in enumerate(depth["depths"])]
    parts.append(f"**Peak / plain peak vs depth** ({depth['model']})\n\n"
                 + _markdown_table(["depth", *depth["peak_bytes"]], rows))
    if summary["meter_agreement"] is not None:
        rows = [[f"`{name}`", _pct(r["relative_difference"], 2)]
                for name, r in summary["meter_agreement"]["variants"].items()]
        parts.append("**Live-tensor meter vs CUDA allocator on the same steps**\n\n"
                     + _markdown_table(["variant", "difference"], rows))
    scaling = summary["scaling"]
    rows = [[name, f"{r['power_fit']['exponent']:.2f}", f"{r['power_fit']['r2']:.3f}", f"{r['log_fit']['r2']:.3f}",
             "yes" if _forward_mismatches(r) == 0 else "no"] for name, r in scaling["modes"].items()]
    parts.append(f"**Scaling** ({scaling['model']}, n = {', '.join(map(str, scaling['ns']))})\n\n" + _markdown_table(
        ["plan", "exponent p of peak ~ n^p", "R² (power)", "R² (log2 n)", "forward calls as planned"], rows))
    rows = [[t["name"], _measured(t),
             f"{t['op']} {t['threshold']}", {True: "met", False: "**missed**", None: "n/a"}[t["met"]], t["source"]]
            for t in summary["targets"]]
    parts.append("**Targets**\n\n" + _markdown_table(["target", "measured", "goal", "", "from"], rows))
    return "\n\n".join(parts) + "\n"


MARKDOWN_BEGIN = "<!-- bench results: begin (written by python -m ckptlib.bench --markdown) -->"
MARKDOWN_END = "<!-- bench results: end -->"


def write_markdown(path: Path | str, summary: dict[str, Any]) -> None:
    """Put :func:`to_markdown` between the two marker lines of ``path`` (appended if absent)."""
    path = Path(path)
    block = f"{MARKDOWN_BEGIN}\n\n{to_markdown(summary)}\n{MARKDOWN_END}"
    text = path.read_text() if path.exists() else ""
    if MARKDOWN_BEGIN in text and MARKDOWN_END in text:
        head, rest = text.split(MARKDOWN_BEGIN, 1)
        text = head + block + rest.split(MARKDOWN_END, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)


# ---------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------

PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "recompute": "tab:green"}
MiB = 2 ** 20


def write_figures(bench: BenchRun, directory: Path | str) -> list[Path]:
    """Draw the figures of one run into ``directory`` (PNG and SVG); returns the paths written."""
    import matplotlib
    from matplotlib.figure import Figure

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    summary = bench.summary
    drawings = {
        "memory_vs_depth": _draw_memory_vs_depth,
        "overhead_per_variant": _draw_overhead,
        "memory_timeline": partial(_draw_timeline, bench.timelines),
        "scaling_peak_vs_n": _draw_scaling,
        "forward_calls_vs_theory": _draw_forward_calls,
    }
    written = []
    # Fixed SVG ids and no dates, so a rerun changes the files only where the numbers changed.
    with matplotlib.rc_context({"svg.hashsalt": "ckptlib.bench", "font.size": 9}):
        for name, draw in drawings.items():
            figure = Figure(figsize=(7.0, 4.2), layout="constrained")
            draw(figure, summary)
            for suffix in ("png", "svg"):
                path = directory / f"{name}.{suffix}"
                figure.savefig(path, dpi=150, metadata={"Date": None} if suffix == "svg" else None)
                written.append(path)
    return written


def _draw_memory_vs_depth(figure: Any, summary: dict[str, Any]) -> None:
    depth = summary["depth"]
    ax = figure.add_subplot()
    # torch and ckptlib per block may coincide: a dashed line with crosses stays visible on top.
    styles = {"torch": dict(marker="x", linestyle="--", markersize=8, zorder=3)}
    for name, peaks in depth["peak_bytes"].items():
        ax.plot(depth["depths"], [p / MiB for p in peaks], label=name, **styles.get(name, dict(marker="o")))
    ax.set_xlabel("number of Transformer blocks (depth)")
    ax.set_ylabel(f"peak memory of one training step (MiB, {summary['environment']['meter']} meter)")
    ax.set_xticks(depth["depths"])
    ax.set_ylim(bottom=0)
    saving = depth["saving_vs_plain"]["ckptlib"]
    same = "; torch's peaks are the same" if depth["peak_bytes"]["torch"] == depth["peak_bytes"]["ckptlib"] else ""
    ax.set_title(f"Per-block checkpointing saves {saving[0] * 100:.0f}% of the peak at depth {depth['depths'][0]}, "
                 f"{saving[-1] * 100:.0f}% at depth {depth['depths'][-1]}{same}\n{depth['model']}", fontsize=9)
    ax.legend(title="checkpointing")
    ax.grid(alpha=0.3)


def _draw_overhead(figure: Any, summary: dict[str, Any]) -> None:
    ax = figure.add_subplot()
    labels, values, spreads, colours = [], [], [], []
    for colour, (group_name, group) in zip(("tab:blue", "tab:purple", "tab:gray"), summary["groups"].items()):
        for name, variant in group["variants"].items():
            if name == "plain":
                continue
            labels.append(f"{group_name}/{name}")
            values.append(variant["time_vs_plain"])
            spreads.append(variant["time_vs_plain_iqr"] / 2)
            colours.append(colour)
    positions = range(len(labels))
    ax.barh(positions, values, xerr=spreads, color=colours, alpha=0.8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(list(positions), labels)
    ax.invert_yaxis()
    ax.set_xlabel("step time / plain step time of the same round: median (bars: ± half the IQR)")
    blocks = summary["groups"]["blocks"]["variants"]
    ax.set_title(f"Recomputing costs time: per block x{blocks['ckptlib']['time_vs_plain']:.2f} (ckptlib), "
                 f"x{blocks['torch']['time_vs_plain']:.2f} (torch)\nstep time vs plain on "
                 f"{summary['environment']['device']}, median of {summary['environment']['rounds']} interleaved rounds")
    ax.grid(axis="x", alpha=0.3)


def _draw_timeline(timelines: dict[str, list[TimelineEntry]], figure: Any, summary: dict[str, Any]) -> None:
    from matplotlib.lines import Line2D

    variants = summary["groups"]["blocks"]["variants"]
    axes = figure.subplots(2, 1, sharex=True, sharey=True)
    for ax, name in zip(axes, ("plain", "ckptlib")):
        timeline = timelines[f"blocks/{name}"]
        ax.plot([e.index for e in timeline], [e.live_bytes / MiB for e in timeline], color="0.6", linewidth=0.6)
        for phase, colour in PHASE_COLOURS.items():
            points = [e for e in timeline if e.phase == phase]
            # Rasterised: thousands of dots would make the SVG heavy for no visible gain.
            ax.scatter([e.index for e in points], [e.live_bytes / MiB for e in points], s=3, color=colour,
                       rasterized=True)
        ax.set_ylabel("live MiB")
        ax.set_title(f"{variants[name]['label']}: peak {format_bytes(variants[name]['peak_bytes'])}", fontsize=9)
        ax.grid(alpha=0.3)
    markers = [Line2D([], [], marker="o", linestyle="none", color=colour, label=phase)
               for phase, colour in PHASE_COLOURS.items()]
    axes[0].legend(handles=markers, loc="upper right")
    axes[1].set_xlabel("aten op index within one training step")
    saving = 1 - variants["ckptlib"]["memory_vs_plain"]
    figure.suptitle(f"One training step: per-block checkpointing lowers the peak by {saving * 100:.0f}%, "
                    "recomputing in backward\n" + summary["groups"]["blocks"]["model"], fontsize=10)


def _draw_scaling(figure: Any, summary: dict[str, Any]) -> None:
    from matplotlib.ticker import FuncFormatter

    scaling = summary["scaling"]
    ax = figure.add_subplot()
    ns = scaling["ns"]
    for name, record in scaling["modes"].items():
        fit = record["power_fit"]
        line = ax.plot(ns, [p / MiB for p in record["peak_bytes"]], marker="o", linestyle="none")[0]
        ax.plot(ns, [fit["coefficient"] * n ** fit["exponent"] / MiB for n in ns], color=line.get_color(),
                linewidth=1, label=f"{name}: fit n^{fit['exponent']:.2f}")
    fit = scaling["modes"]["recursive"]["log_fit"]
    ax.plot(ns, [(fit["intercept"] + fit["per_doubling"] * math.log2(n)) / MiB for n in ns], color="black",
            linewidth=1, linestyle="--", label="recursive: fit a + b log2(n)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_xlabel("chain length n (layers)")
    ax.set_ylabel("activation peak of one step (MiB)")
    modes = scaling["modes"]
    ax.set_title(f"sqrt(n) segments: memory grows like n^{modes['sqrt']['power_fit']['exponent']:.2f}; "
                 f"recursive adds {format_bytes(modes['recursive']['log_fit']['per_doubling'])} per doubling "
                 f"(log fit R²={modes['recursive']['log_fit']['r2']:.2f})\n{scaling['model']}", fontsize=9)
    ax.legend(title="measured (dots) and fits (lines)")
    ax.grid(alpha=0.3, which="both")


def _draw_forward_calls(figure: Any, summary: dict[str, Any]) -> None:
    scaling = summary["scaling"]
    ax = figure.add_subplot()
    ns = scaling["ns"]
    mismatches = 0
    for name, record in scaling["modes"].items():
        line = ax.plot(ns, [s / n for s, n in zip(record["plan_forward_steps"], ns)], linewidth=1,
                       label=f"{name}: plan.forward_steps")[0]
        ax.plot(ns, [(c - n) / n for c, n in zip(record["forward_calls"], ns)], marker="o", linestyle="none",
                color=line.get_color(), label=f"{name}: counted calls - n")
        mismatches += _forward_mismatches(record)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("chain length n (layers)")
    ax.set_ylabel("recomputed layer forwards per step / n")
    verdict = ("counted forward calls equal the plans' at every n" if mismatches == 0
               else f"{mismatches} runs differ from their plan's forward calls")
    ax.set_title(f"Recomputation work: {verdict}\n{scaling['model']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError:
        raise SystemExit(f"--device {name}: the bench measures on 'cpu' or 'cuda'.") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ckptlib.bench",
        description="Peak memory and step time of plain autograd, torch.utils.checkpoint and ckptlib "
                    "(per block, sqrt(n) plans, selective, offload), measured in one interleaved run.")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: the allocator meter, synchronised timing")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and shorter sweeps")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 15, 5 with --quick)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", type=Path, metavar="PATH",
                        help="write the ratio tables into PATH between the bench's marker lines")
    parser.add_argument("--figures", type=Path, metavar="DIR", help="draw the figures into DIR")
    parser.add_argument("--from-json", type=Path, metavar="PATH",
                        help="report a saved run instead of measuring (not with --figures)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time (default) or this process's CPU time (a busy CPU; use with --threads 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's malloc as it is (default: keep freed memory for reuse; see the module docstring)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.from_json is not None:
        if args.figures is not None:
            raise SystemExit("--figures needs a fresh run (the per-op timelines are not in the JSON); "
                             "leave out --from-json.")
        summary = json.loads(args.from_json.read_text())
        if summary.get("schema") != SCHEMA:
            raise SystemExit(f"{args.from_json}: schema {summary.get('schema')!r} is not {SCHEMA!r}; "
                             "rerun the bench to write a current file.")
        bench = BenchRun(summary, {})
    else:
        config = QUICK if args.quick else DEFAULT
        if args.rounds is not None:
            if args.rounds < 1:
                raise SystemExit(f"--rounds {args.rounds}: need at least one round.")
            config = replace(config, rounds=args.rounds)
        config = replace(config, clock=args.clock)
        if args.threads is not None:
            if args.threads < 1:
                raise SystemExit(f"--threads {args.threads}: need at least one thread.")
            torch.set_num_threads(args.threads)   # this process is the benchmark: the setting is ours
        if not args.system_malloc:
            keep_freed_memory()
        try:
            bench = run(config, _device(args.device), progress=None if args.no_progress else "auto")
        except BenchError as error:
            raise SystemExit(str(error)) from None
    print(format_report(bench.summary))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(bench.summary, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    if args.markdown is not None:
        write_markdown(args.markdown, bench.summary)
        print(f"wrote the results section of {args.markdown}")
    if args.figures is not None:
        for path in write_figures(bench, args.figures):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
