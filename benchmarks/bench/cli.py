"""The command line, ``python -m benchmarks.bench``: measure (or read a saved run), then print,
write and draw.

Every argument is checked before anything is measured: a run takes minutes, and
a typo in an output path should not cost them. ``--from-json`` reports a saved
run, so the options that only shape a measurement are refused with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from benchmarks.bench.config import CLOCKS, Config
from benchmarks.bench.figures import write_figures
from benchmarks.bench.report import format_report, write_markdown
from benchmarks.bench.summary import (
    BenchError,
    BenchRun,
    as_device,
    check_device,
    check_summary,
    run,
)
from benchmarks.bench.timing import keep_freed_memory

# Options that shape a measurement, and their defaults (None: not given on the command line).
_MEASURING = {
    "device": "cpu",
    "quick": False,
    "rounds": None,
    "threads": None,
    "clock": "wall",
    "no_progress": False,
    "system_malloc": False,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="Peak memory and step time of plain autograd, torch.utils.checkpoint and "
        "ckptlib (per block, sqrt(n) plans, selective, offload), measured in one interleaved run.",
    )
    parser.add_argument(
        "--device", help="cpu (default) or cuda: the allocator meter, synchronised timing"
    )
    parser.add_argument(
        "--quick", action="store_true", default=None, help="fewer rounds and shorter sweeps"
    )
    parser.add_argument(
        "--rounds", type=int, help="interleaved timing rounds (default 15, 5 with --quick)"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="PATH",
        help="write the ratio tables into PATH between the bench's marker lines",
    )
    parser.add_argument("--figures", type=Path, metavar="DIR", help="draw the figures into DIR")
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="report a saved run instead of measuring (not with --figures)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        help="wall time (default) or this process's CPU time (a busy CPU; use with --threads 1)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", default=None, help="no progress bar on stderr"
    )
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        default=None,
        help="leave glibc's malloc as it is (default: keep freed memory for reuse; "
        "see benchmarks/bench/timing.py)",
    )
    return parser


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail now, not after the run, on an output that cannot be written."""
    if args.json is not None and args.json.is_dir():
        raise SystemExit(
            f"--json {args.json}: is a directory; give a file path such as "
            f"{args.json / 'cpu.json'}."
        )
    if args.markdown is not None and (args.markdown.is_dir() or not args.markdown.parent.is_dir()):
        raise SystemExit(
            f"--markdown {args.markdown}: need a file in an existing directory (the tables go "
            "between the bench's marker lines, or at the end)."
        )
    if args.figures is not None and args.figures.exists() and not args.figures.is_dir():
        raise SystemExit(
            f"--figures {args.figures}: is a file; give a directory (created if missing)."
        )


def _saved_run(args: argparse.Namespace) -> BenchRun:
    if args.figures is not None:
        raise SystemExit(
            "--figures needs a fresh run (the per-op timelines are not in the JSON); "
            "leave out --from-json. (From Python, write_figures(BenchRun(summary, {}), DIR, "
            "names=...) redraws the other figures of a saved run.)"
        )
    given = [
        f"--{name.replace('_', '-')}" for name in _MEASURING if getattr(args, name) is not None
    ]
    if given:
        raise SystemExit(
            f"{' '.join(given)}: only for a measurement; --from-json reports a saved run as it was."
        )
    try:
        summary = json.loads(args.from_json.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SystemExit(
            f"--from-json {args.from_json}: cannot read a JSON summary ({error})."
        ) from None
    try:
        check_summary(summary, str(args.from_json))
    except BenchError as error:
        raise SystemExit(str(error)) from None
    return BenchRun(summary, {})


def _config(args: argparse.Namespace) -> Config:
    """``QUICK`` or ``DEFAULT`` with the options given. The presets are looked up on the package at
    call time, so a caller can swap them (the tests run the command line at ``TINY`` sizes)."""
    presets = sys.modules["benchmarks.bench"]
    config = presets.QUICK if args.quick else presets.DEFAULT
    if args.rounds is not None:
        if args.rounds < 1:
            raise SystemExit(f"--rounds {args.rounds}: need at least one round.")
        config = replace(config, rounds=args.rounds)
    return replace(config, clock=args.clock)


def _measured_run(args: argparse.Namespace) -> BenchRun:
    for name, default in _MEASURING.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    config = _config(args)
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads {args.threads}: need at least one thread.")
    try:
        device = as_device(args.device)
        check_device(device, config.clock)
    except BenchError as error:
        raise SystemExit(str(error)) from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # this process is the benchmark: the setting is ours
    if not args.system_malloc:
        keep_freed_memory()
    return run(config, device, progress=None if args.no_progress else "auto")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check_outputs(args)
    bench = _saved_run(args) if args.from_json is not None else _measured_run(args)
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
