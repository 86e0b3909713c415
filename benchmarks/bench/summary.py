"""One whole run: every group and sweep measured, gathered into the JSON summary with the targets
it is judged by.

The summary (``SUMMARY_KEYS``, schema ``SCHEMA``) is what ``--json`` writes and
``--from-json`` reads back; the report and the figures are drawn from it alone,
except the per-op memory timelines, which stay in memory (``BenchRun``).
The *targets* are the goals set for the library and its schedules (ckptlib no
slower and no bigger than torch per block, selective policies keeping half of
full checkpointing's saving for at most half of its extra time, sqrt(n) memory
growing like n^0.5 ...), each with the measured value and whether it was met.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from benchmarks.bench.config import DEFAULT, METER_VARIANTS, Config, Group, build_groups
from benchmarks.bench.progress import ProgressBar, Ticker
from benchmarks.bench.sweeps import forward_mismatches, run_depths, run_meter_agreement, run_scaling
from benchmarks.bench.timing import describe_environment, run_group
from ckptlib.memory import TimelineEntry

SCHEMA = "ckptlib.bench/1"
SUMMARY_KEYS = (
    "schema",
    "environment",
    "groups",
    "meter_overhead",
    "seed_claims",
    "depth",
    "scaling",
    "meter_agreement",
    "targets",
)

# The seed article's claims, quoted: the inputs the bench compares its measurements with.
SEED_CLAIMS = (
    {
        "claim": "30-50% less memory for 20-30% more time",
        "memory_saving": [0.30, 0.50],
        "time_overhead": [0.20, 0.30],
    },
    {
        "claim": "48 GB -> 28 GB (-42%) at +15% time",
        "memory_saving": [1 - 28 / 48, 1 - 28 / 48],
        "time_overhead": [0.15, 0.15],
    },
)

# PyTorch's selective checkpointing as an earlier run of this bench measured it (4 blocks,
# d_model 256, seq 256, CPU).
TORCH_SAC_REFERENCE = {"saving_kept": 0.36, "extra_time_paid": 0.63}


@dataclass
class BenchRun:
    """What one run measured: ``summary`` is the JSON document; ``timelines`` (per op, for the
    timeline figure) stay in memory, ``"group/variant" -> list of TimelineEntry``."""

    summary: dict[str, Any]
    timelines: dict[str, list[TimelineEntry]]


def _work_units(config: Config, groups: list[Group], device: torch.device) -> int:
    units = 0
    for group in groups:
        variants = len(group.variants)
        units += variants * (2 + config.rounds) - sum(v.metered is not None for v in group.variants)
    units += len(config.depths) * 4 + len(config.scaling_ns) * 3
    if device.type == "cuda":
        units += sum(v.metered is None for group in groups[:2] for v in group.variants)
    return units


def run(
    config: Config = DEFAULT,
    device: torch.device | str = "cpu",
    progress: ProgressBar | None | str = "auto",
) -> BenchRun:
    """Run every group and sweep once; ``progress="auto"`` draws a bar on stderr, ``None`` none.

    Returns the JSON summary (see ``SUMMARY_KEYS``) and the per-op timelines.
    """
    if not isinstance(config, Config):
        raise TypeError(
            f"run: config must be a Config (DEFAULT, QUICK, TINY or one made from them with "
            f"dataclasses.replace), got {type(config).__name__}."
        )
    if not (progress is None or progress == "auto" or isinstance(progress, ProgressBar)):
        raise TypeError(
            f"run: progress must be 'auto' (a bar on stderr), None (no bar) or a ProgressBar, "
            f"got {progress!r}."
        )
    device = as_device(device)
    check_device(device, config.clock)
    if device.type == "cuda":
        torch.cuda.init()  # before any checkpoint: its RNG state must exist to be saved
    groups = build_groups(config, device)
    bar = ProgressBar(_work_units(config, groups, device)) if progress == "auto" else progress
    ticker = Ticker(bar if isinstance(bar, ProgressBar) else None)
    timelines: dict[str, list[TimelineEntry]] = {}
    try:
        results = {
            group.name: run_group(group, config, device, ticker, timelines) for group in groups
        }
        depth = run_depths(config, device, ticker)
        scaling = run_scaling(config, device, ticker)
        agreement = run_meter_agreement(groups, device, ticker) if device.type == "cuda" else None
    finally:
        if isinstance(bar, ProgressBar):
            bar.close()
    results["selective"]["tradeoffs"]["torch_save_matmuls"]["earlier_measurement"] = dict(
        TORCH_SAC_REFERENCE
    )
    blocks = results["blocks"]["variants"]
    summary = {
        "schema": SCHEMA,
        "environment": describe_environment(config, device),
        "groups": results,
        "meter_overhead": {
            kind: blocks[name]["time_vs_plain"] for kind, name in METER_VARIANTS.items()
        },
        "seed_claims": _seed_claims(results),
        "depth": depth,
        "scaling": scaling,
        "meter_agreement": agreement,
    }
    summary["targets"] = _targets(summary)
    return BenchRun(summary, timelines)


def _seed_claims(results: dict[str, Any]) -> dict[str, Any]:
    measured = []
    for group, name in (
        ("blocks", "ckptlib"),
        ("blocks", "torch"),
        ("blocks", "sqrt"),
        ("selective", "ckptlib"),
        ("selective", "ckptlib_save_matmuls"),
        ("selective", "ckptlib_megatron"),
        ("selective", "ckptlib_cost_policy"),
        ("selective", "ckptlib_cost_policy_plans"),
    ):
        variant = results[group]["variants"][name]
        measured.append(
            {
                "variant": f"{group}/{name}",
                "label": variant["label"],
                "memory_saving": 1 - variant["memory_vs_plain"],
                "time_overhead": variant["time_vs_plain"] - 1,
            }
        )
    return {"claims": [dict(claim) for claim in SEED_CLAIMS], "measured": measured}


def _target(
    name: str,
    source: str,
    value: float | None,
    op: str,
    threshold: float,
    interval: Sequence[float] | None = None,
) -> dict[str, Any]:
    met = None if value is None else (value <= threshold if op == "<=" else value >= threshold)
    target = {
        "name": name,
        "source": source,
        "value": value,
        "op": op,
        "threshold": threshold,
        "met": met,
    }
    if interval is not None:
        target["interval"] = list(interval)
    return target


def _targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    groups, scaling = summary["groups"], summary["scaling"]["modes"]
    blocks = groups["blocks"]
    targets = [
        _target(
            "ckptlib/torch peak memory, per block",
            "the library's goal",
            blocks["pairs"]["ckptlib_vs_torch"]["memory"],
            "<=",
            1.0,
        ),
        _target(
            "ckptlib/torch step time, per block",
            "the library's goal",
            blocks["pairs"]["ckptlib_vs_torch"]["time"],
            "<=",
            1.0,
        ),
        _target(
            "per-block checkpointing: share of the plain peak saved",
            "the library's goal",
            1 - blocks["variants"]["ckptlib"]["memory_vs_plain"],
            ">=",
            0.60,
        ),
        _target(
            "live-tensor meter: metered/unmetered step time",
            "the library's goal",
            summary["meter_overhead"]["peak"],
            "<=",
            1.5,
        ),
    ]
    for name in (
        "ckptlib_save_matmuls",
        "ckptlib_megatron",
        "ckptlib_cost_policy",
        "ckptlib_cost_policy_plans",
        "torch_save_matmuls",
    ):
        tradeoff = groups["selective"]["tradeoffs"][name]
        targets += [
            _target(
                f"{name}: share of full checkpointing's saving kept",
                "the selective and schedule goals",
                tradeoff["saving_kept"],
                ">=",
                0.5,
            ),
            _target(
                f"{name}: share of full checkpointing's extra time paid",
                "the selective and schedule goals",
                tradeoff["extra_time_paid"],
                "<=",
                0.5,
                interval=tradeoff.get("extra_time_paid_interval"),
            ),
        ]
    mismatches = sum(forward_mismatches(record) for record in scaling.values())
    targets += [
        _target(
            "sqrt(n) plan: exponent of peak vs n",
            "the selective and schedule goals",
            scaling["sqrt"]["power_fit"]["exponent"],
            "<=",
            0.55,
        ),
        # "grows like log n": a straight line against log2(n) explains the peaks.
        _target(
            "recursive plan: R^2 of peak vs log2(n)",
            "threshold set here",
            scaling["recursive"]["log_fit"]["r2"],
            ">=",
            0.95,
        ),
        _target(
            "scaling runs whose forward calls differ from the plan's",
            "the selective and schedule goals",
            mismatches,
            "<=",
            0,
        ),
    ]
    if summary["meter_agreement"] is not None:
        targets.append(
            _target(
                "|live-tensor meter / allocator - 1|, worst variant",
                "the library's goal",
                summary["meter_agreement"]["worst_relative_difference"],
                "<=",
                0.02,
            )
        )
    return targets


class BenchError(Exception):
    """The bench cannot run as asked (no CUDA, a clock that cannot time the device ...)."""


def as_device(device: torch.device | str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise BenchError(f"--device {device}: the bench measures on 'cpu' or 'cuda'.") from None


def check_device(device: torch.device, clock: str) -> None:
    if device.type not in ("cpu", "cuda"):
        raise BenchError(f"--device {device}: the bench measures on 'cpu' or 'cuda'.")
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (
            "" if torch.version.cuda else ", a build without CUDA"
        )
        raise BenchError(
            f"--device cuda: no CUDA device is available ({build}). Run on a machine with an "
            "NVIDIA GPU and a CUDA build of torch, or leave out --device cuda to measure on CPU."
        )
    if clock == "cpu":
        raise BenchError(
            "--clock cpu counts host CPU time, not the GPU's: use the wall clock with "
            "--device cuda (the bench synchronises around each step)."
        )


def check_summary(summary: Any, source: str = "summary") -> None:
    """``summary`` must be what :func:`run` returns in ``BenchRun.summary`` (or a JSON file of it)
    in the current schema: the report and the figures read every key of it."""
    schema = summary.get("schema") if isinstance(summary, dict) else None
    if schema != SCHEMA:
        found = f"schema {schema!r}" if isinstance(summary, dict) else f"a {type(summary).__name__}"
        raise BenchError(
            f"{source}: {found} is not a ckptlib.bench summary of schema {SCHEMA!r}; "
            "rerun the bench to write a current one."
        )
