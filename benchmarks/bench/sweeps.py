"""The sweeps, memory only: peak vs depth per checkpointing mode, and the scaling run (peak vs
chain length n).

Design notes
============

The depth sweep trains the ``blocks`` Transformer at each depth of
``Config.depths`` under plain autograd, ``torch.utils.checkpoint`` and
``ckptlib.checkpoint`` per block, and a sqrt(n) ``checkpoint_sequential``.

The *scaling run* measures peak vs chain length n (16 ... 256) of an
``MLPChain`` under plain autograd, a sqrt(n) plan and a recursive plan, with
the module forward calls counted and compared with the plan's prediction
(``plan.forward_calls``: the ``n`` first forwards plus ``plan.forward_steps``
recomputed ones). It measures *activation* memory: the gradients are allocated
by a warm-up step and accumulate in place during the measured one, so the peak
is what the schedule keeps, and its growth with n is the schedule's, not the
parameters'. Each mode's peaks get a power-law fit and a log fit
(:mod:`ckptlib.fits`).

On CUDA, the allocator and the live-tensor meter also measure the same steps,
and the two are compared (``meter_agreement``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from benchmarks.bench.config import Config, Group, Variant
from benchmarks.bench.progress import Ticker
from benchmarks.bench.stats import ratio
from benchmarks.bench.timing import measure_peak
from ckptlib.fits import fit_log, fit_power_law
from ckptlib.memory import MemoryMeter
from ckptlib.models import MLPChain
from ckptlib.schedules import Plan, recursive, sqrt_n


def run_depths(config: Config, device: torch.device, progress: Ticker) -> dict[str, Any]:
    modes = {"plain": "none", "torch": "torch", "ckptlib": "block", "sqrt": "sqrt"}
    peaks: dict[str, list[int]] = {name: [] for name in modes}
    size = config.blocks
    for depth in config.depths:
        for name, mode in modes.items():
            model = size.build(device, depth=depth, checkpointing=mode)
            variant = Variant(name, name, model, model.example_batch(batch=size.batch))
            variant.step()
            peaks[name].append(measure_peak(variant, device)[0])
            progress.tick(f"depth {depth}: {name}")
    return {
        "model": size.describe(depth="d"),
        "depths": list(config.depths),
        "peak_bytes": peaks,
        "saving_vs_plain": {
            name: [1 - p / q for p, q in zip(values, peaks["plain"])]
            for name, values in peaks.items()
            if name != "plain"
        },
    }


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


def run_scaling(config: Config, device: torch.device, progress: Ticker) -> dict[str, Any]:
    modes: dict[str, dict[str, list]] = {}
    for n in config.scaling_ns:
        for name, plan in _scaling_plans(n).items():
            model = MLPChain(depth=n, width=config.scaling_width, checkpointing=plan).to(device)
            batch = model.example_batch(batch=config.scaling_batch)
            model.loss(
                batch
            ).backward()  # allocates the .grad tensors the measured step accumulates into
            counter = _ForwardCounter(model.blocks)
            with MemoryMeter(device, timeline=False) as meter:
                model.loss(batch).backward()
            counter.remove()
            record = modes.setdefault(
                name,
                {
                    key: []
                    for key in (
                        "peak_bytes",
                        "forward_calls",
                        "plan_forward_calls",
                        "plan_forward_steps",
                        "plan_peak_activations",
                    )
                },
            )
            record["peak_bytes"].append(meter.peak_bytes)
            record["forward_calls"].append(counter.calls)
            # Plain autograd as a plan: n forwards, nothing recomputed, every activation kept.
            record["plan_forward_calls"].append(n if isinstance(plan, str) else plan.forward_calls)
            record["plan_forward_steps"].append(0 if isinstance(plan, str) else plan.forward_steps)
            record["plan_peak_activations"].append(
                n if isinstance(plan, str) else plan.peak_activations
            )
            progress.tick(f"scaling n={n}: {name}")
    for record in modes.values():
        record["power_fit"] = fit_power_law(config.scaling_ns, record["peak_bytes"])
        record["log_fit"] = fit_log(config.scaling_ns, record["peak_bytes"])
    return {
        "model": f"MLPChain(depth=n, width={config.scaling_width}), batch {config.scaling_batch}",
        "activation_bytes_per_layer": 4 * config.scaling_width * config.scaling_batch,
        "ns": list(config.scaling_ns),
        "modes": modes,
    }


def run_meter_agreement(
    groups: list[Group], device: torch.device, progress: Ticker
) -> dict[str, Any]:
    """CUDA only: the allocator and the live-tensor meter on the same steps."""
    rows = {}
    for group in groups[:2]:
        for variant in group.variants:
            if variant.metered is not None:
                continue
            allocator_bytes = measure_peak(variant, device, backend="allocator")[0]
            tensors_bytes = measure_peak(variant, device, backend="tensors")[0]
            rows[f"{group.name}/{variant.name}"] = {
                "allocator_bytes": allocator_bytes,
                "tensors_bytes": tensors_bytes,
                "relative_difference": ratio(tensors_bytes - allocator_bytes, allocator_bytes),
            }
            progress.tick(f"meter agreement: {group.name}/{variant.name}")
    worst = max((abs(row["relative_difference"] or 0.0) for row in rows.values()), default=None)
    return {"variants": rows, "worst_relative_difference": worst}


def forward_mismatches(record: dict[str, list[int]]) -> int:
    return sum(
        counted != planned
        for counted, planned in zip(record["forward_calls"], record["plan_forward_calls"])
    )
