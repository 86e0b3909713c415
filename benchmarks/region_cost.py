"""What one checkpointed region costs, part by part, beside a bare hook-based floor and torch's.

    python benchmarks/region_cost.py [--rounds 30] [--json benchmarks/results/region_cost.json]
                                     [--markdown benchmarks/README.md] [--from-json FILE]

Four workloads, each one training step (forward, ``square().sum()``, backward):

* two tiny regions (almost no work: the fixed cost of a region): ``torch.sin`` of 4 numbers, and
  a plain Python function that calls it (what a user's function is; the checkpoint treats both
  alike);
* an ``MLPChain`` block (Linear + ReLU, width 256, batch 8);
* a ``TinyTransformer`` block (d_model 128, 4 heads, seq 64, batch 8).

Variants, all in one run, interleaved (each round runs every variant once, in a rotating order):

* ``plain``: no checkpoint; ``torch.utils.checkpoint``: ``use_reentrant=False``;
* ``floor``: the bare hook-based checkpoint of this file (pack a handle; the first unpack reruns
  the function once under a second hook that fills the handles): no RNG, no checks;
* ``ckptlib, no early stop``: ``ckptlib.checkpoint`` with ``preserve_rng_state=False``,
  ``determinism_check="none"``, ``early_stop=False`` and its checks (``core/checks.py``)
  replaced by ones that check nothing (in this script only); ``ckptlib, hooks only``: the same
  with early stop (the rerun stops at its last needed tensor by raising an exception from the
  pack hook, which unwinds through the op's C++ code: torch's checkpoint stops the same way);
* ``+ RNG``: the same with the RNG captured and replayed; ``+ keys``: and each saved tensor's
  key compared; ``ckptlib``: as shipped, every check on.

The cost of a variant is its step time minus the plain step's, so the work of the region itself
cancels out; the breakdown subtracts neighbouring variants: Python (the frame, holders,
contexts: ``ckptlib, no early stop`` minus ``floor``), early stop, RNG, keys, guards. Timing:
one torch thread, this process's CPU time. Costs and ratios come from each variant's fastest
round (timeit's rule: whatever else the machine does only adds time, and every variant gets the
same chances at a quiet moment, since the rounds interleave them); the median and quartiles of
the rounds are reported beside them, so a spread wider than a difference says it is noise.

Guards, not targets (printed after the tables, from the same run): the plain Python
function's region costs at most 0.8x what torch's checkpoint costs, and an MLP and a Transformer
block's step takes at most 1.0x torch's.

Beside the times: the reading path, the ckptlib files, lines and functions one step of the plain
Python function runs (:func:`calls_per_step`, with ``sys.setprofile``; exact, not a timing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckptlib
from ckptlib.core import checkpoint as core_checkpoint
from ckptlib.core.checks import storage_ptrs
from ckptlib.models import MLPChain, TinyTransformer


class _Handle:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self) -> None:
        self.tensor = None


def floor_checkpoint(fn: Callable[..., Any], *args: torch.Tensor) -> Any:
    """The least a hook-based checkpoint does: handles in forward, one rerun to fill them."""
    handles: list[weakref.ReferenceType[_Handle]] = []

    def pack(tensor: torch.Tensor) -> _Handle:
        handle = _Handle()
        handles.append(weakref.ref(handle))
        return handle

    def unpack(handle: _Handle) -> torch.Tensor:
        if handle.tensor is None:
            order = iter(handles)

            def fill(tensor: torch.Tensor) -> torch.Tensor:
                target = next(order)()
                if target is not None:
                    target.tensor = tensor.detach()
                return tensor

            inputs = [a.detach().requires_grad_(a.requires_grad) for a in args]
            with torch.autograd.graph.saved_tensors_hooks(fill, lambda t: t), torch.enable_grad():
                fn(*inputs)
        tensor, handle.tensor = handle.tensor, None
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(*args)


def python_sin(t: torch.Tensor) -> torch.Tensor:
    """A plain Python function: the tiny region as a user writes one."""
    return torch.sin(t)


class _NoChecks:
    """Checks that check nothing (``ckptlib, hooks only`` and ``+ RNG``, ``+ keys``): the core
    still calls them, so the checks row counts what the checks do, not the calls. (The inputs'
    storages stay known: the keys mark a saved input as one.)"""

    generators: list = []

    def __init__(self, fn: Any, inputs: list[torch.Tensor], *rest: Any) -> None:
        self.input_ptrs = storage_ptrs(inputs)

    def on_pack(self, *args: Any) -> None:
        pass

    on_fill = after_forward = after_recompute = on_pack

    def during_forward(self) -> None:
        return None

    def before_recompute(self, frame: Any) -> None:
        return None

    def mismatch_causes(self) -> str:
        return ""

    def lost_transform(self) -> None:
        return None


@contextlib.contextmanager
def _checks_off() -> Iterator[None]:
    original = core_checkpoint.Checks
    core_checkpoint.Checks = _NoChecks
    try:
        yield
    finally:
        core_checkpoint.Checks = original


def _ckptlib(
    rng: bool, keys: bool, guarded: bool, early_stop: bool = True
) -> Callable[[], contextlib.AbstractContextManager]:
    check = "default" if keys else "none"

    def run(fn, x):
        return ckptlib.checkpoint(
            fn, x, preserve_rng_state=rng, determinism_check=check, early_stop=early_stop
        )

    return lambda: contextlib.nullcontext(run) if guarded else _with(_checks_off(), run)


@contextlib.contextmanager
def _with(context: contextlib.AbstractContextManager, run: Callable) -> Iterator[Callable]:
    with context:
        yield run


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "plain": lambda: contextlib.nullcontext(lambda fn, x: fn(x)),
    "torch.utils.checkpoint": lambda: contextlib.nullcontext(
        lambda fn, x: torch_checkpoint(fn, x, use_reentrant=False)
    ),
    "floor": lambda: contextlib.nullcontext(floor_checkpoint),
    "ckptlib, no early stop": _ckptlib(rng=False, keys=False, guarded=False, early_stop=False),
    "ckptlib, hooks only": _ckptlib(rng=False, keys=False, guarded=False),
    "+ RNG": _ckptlib(rng=True, keys=False, guarded=False),
    "+ keys": _ckptlib(rng=True, keys=True, guarded=False),
    "ckptlib": _ckptlib(rng=True, keys=True, guarded=True),
}
PARTS = {  # breakdown row -> (variant, the variant it is measured against)
    "floor (hooks, one rerun)": ("floor", "plain"),
    "Python: frame, holders, contexts": ("ckptlib, no early stop", "floor"),
    "early stop (an exception through the op)": ("ckptlib, hooks only", "ckptlib, no early stop"),
    "RNG capture and replay": ("+ RNG", "ckptlib, hooks only"),
    "keys compared at every pack": ("+ keys", "+ RNG"),
    "checks (versions, parameters, in-place)": ("ckptlib", "+ keys"),
}


def workloads() -> dict[str, tuple[Callable, torch.Tensor, int]]:
    """name -> (function, input, steps per round)."""
    torch.manual_seed(0)
    mlp = MLPChain(depth=1, width=256)
    transformer = TinyTransformer(depth=1, d_model=128, heads=4, seq=64)
    return {
        "tiny region (sin of 4 numbers)": (torch.sin, torch.randn(4), 200),
        "tiny region, a Python function (sin of 4 numbers)": (python_sin, torch.randn(4), 200),
        "MLPChain block (width 256, batch 8)": (mlp.blocks[0], torch.randn(8, 256), 20),
        "TinyTransformer block (d_model 128, seq 64, batch 8)": (
            transformer.blocks[0],
            torch.randn(8, 64, 128),
            10,
        ),
    }


def step(run: Callable, fn: Callable, x: torch.Tensor) -> None:
    run(fn, x.requires_grad_()).square().sum().backward()


def measure(rounds: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    names = list(VARIANTS)
    for workload, (fn, x, steps) in workloads().items():
        for name in names:  # warm up
            with VARIANTS[name]() as run:
                for _ in range(5):
                    step(run, fn, x)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                with VARIANTS[name]() as run:
                    began = time.process_time()
                    for _ in range(steps):
                        step(run, fn, x)
                    samples[name].append((time.process_time() - began) / steps * 1e6)
        best = {name: min(values) for name, values in samples.items()}
        median = {name: statistics.median(values) for name, values in samples.items()}
        quartiles = {name: statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
                     for name, values in samples.items()}
        cost = {name: best[name] - best["plain"] for name in names if name != "plain"}
        results[workload] = {
            "best_us_per_step": {name: round(value, 1) for name, value in best.items()},
            "median_us_per_step": {name: round(value, 1) for name, value in median.items()},
            "quartiles_us_per_step": {
                name: [round(q[0], 1), round(q[2], 1)] for name, q in quartiles.items()
            },
            "cost_us": {name: round(value, 1) for name, value in cost.items()},
            "breakdown_us": {
                part: round(best[a] - best[b], 1) for part, (a, b) in PARTS.items()
            },
            "ratios": {
                "ckptlib cost / torch cost": round(
                    cost["ckptlib"] / cost["torch.utils.checkpoint"], 3
                ),
                "floor cost / torch cost": round(cost["floor"] / cost["torch.utils.checkpoint"], 3),
                "ckptlib step / torch step": round(
                    best["ckptlib"] / best["torch.utils.checkpoint"], 3
                ),
            },
        }
    return {
        "schema": "ckptlib.region_cost/2",
        "reading_path": calls_summary(calls_per_step(python_sin, torch.randn(4))),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": 1,
            "clock": "process CPU time",
            "statistic": "fastest round per variant (median and quartiles beside it)",
            "rounds": rounds,
            "machine": platform.machine(),
        },
        "workloads": results,
    }


def calls_per_step(fn: Callable, x: torch.Tensor) -> dict[str, dict[str, int]]:
    """The ckptlib functions one checkpointed training step runs (forward, backward), counted
    with ``sys.setprofile`` after a warm-up: file -> {function: calls}. Comprehensions count as
    the functions they are in Python 3.11; C functions and torch's own are not counted. (The
    reading path is these files and ``core/errors.py``, whose messages a normal step never
    formats.)"""
    root = str(Path(ckptlib.__file__).resolve().parent) + "/"
    counted: dict[str, dict[str, int]] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls = counted.setdefault(frame.f_code.co_filename[len(root):], {})
            name = frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname") \
                else frame.f_code.co_name
            calls[name] = calls.get(name, 0) + 1

    run = lambda fn, x: ckptlib.checkpoint(fn, x)  # noqa: E731  (as shipped: every guard on)
    for _ in range(3):
        step(run, fn, x)
    sys.setprofile(profile)
    try:
        step(run, fn, x)
    finally:
        sys.setprofile(None)
    return counted


def calls_summary(counted: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Distinct functions and calls in all, and per file: its lines and distinct functions."""
    root = Path(ckptlib.__file__).resolve().parent
    files = {path: {"lines": len((root / path).read_text().splitlines()),
                    "functions": len(calls)} for path, calls in sorted(counted.items())}
    return {"distinct functions": sum(map(len, counted.values())),
            "calls": sum(sum(calls.values()) for calls in counted.values()),
            "lines": sum(f["lines"] for f in files.values()), "files": files}


def functions_line(summary: dict[str, Any]) -> str:
    per_file = ", ".join(f"{path}: {f['lines']} lines, {f['functions']} functions"
                         for path, f in summary["files"].items())
    return (f"{len(summary['files'])} files, {summary['lines']} lines, "
            f"{summary['distinct functions']} functions, {summary['calls']} calls ({per_file})")


PLAIN_FUNCTION = "tiny region, a Python function (sin of 4 numbers)"
BLOCKS = ("MLPChain block (width 256, batch 8)",
          "TinyTransformer block (d_model 128, seq 64, batch 8)")


def guards(result: dict) -> list[str]:
    """The guards of this run, one line each: the plain function's region cost at most 0.8x
    torch's, each block's step at most 1.0x torch's (workloads this run did not measure are
    left out)."""
    lines = []
    checks = [(PLAIN_FUNCTION, "ckptlib cost / torch cost", 0.8)]
    checks += [(block, "ckptlib step / torch step", 1.0) for block in BLOCKS]
    for workload, ratio, limit in checks:
        numbers = result["workloads"].get(workload)
        if numbers is not None:
            value = numbers["ratios"][ratio]
            verdict = "within" if value <= limit else "OVER"
            lines.append(f"{workload}: {ratio} {value:.3f} ({verdict} the guard, at most {limit})")
    return lines


def table(result: dict) -> str:
    lines = []
    for workload, numbers in result["workloads"].items():
        lines.append(workload)
        for name, value in numbers["best_us_per_step"].items():
            low, high = numbers["quartiles_us_per_step"][name]
            median = numbers["median_us_per_step"][name]
            extra = (
                f"   cost {numbers['cost_us'][name]:+8.1f} us" if name in numbers["cost_us"] else ""
            )
            lines.append(
                f"  {name:<26} {value:>9.1f} us per step (median {median:.1f}, quartiles "
                f"{low:.1f} to {high:.1f}){extra}"
            )
        lines.append("  breakdown of ckptlib's cost:")
        for part, value in numbers["breakdown_us"].items():
            lines.append(f"    {part:<42} {value:+8.1f} us")
        for name, value in numbers["ratios"].items():
            lines.append(f"  {name:<30} {value:.3f}")
    lines.append("reading path (one step of a plain Python function): "
                 + functions_line(result["reading_path"]))
    lines += ["guard: " + line for line in guards(result)]
    return "\n".join(lines)


MARKDOWN_BEGIN = "<!-- region cost: begin (written by benchmarks/region_cost.py --markdown) -->"
MARKDOWN_END = "<!-- region cost: end -->"


def markdown(result: dict) -> str:
    env = result["environment"]
    head = [
        f"torch {env['torch']}, {env['threads']} thread, {env['clock']}, "
        f"{env['rounds']} interleaved rounds; cost = fastest step time minus the plain step's, "
        "in us (quartiles of the step times in brackets).",
        "",
    ]
    columns = [
        "torch.utils.checkpoint",
        "floor",
        "ckptlib, no early stop",
        "ckptlib, hooks only",
        "+ RNG",
        "+ keys",
        "ckptlib",
    ]
    lines = head + [
        "| workload | " + " | ".join(columns)
        + " | ckptlib / torch | floor / torch | ckptlib step / torch step |",
        "| --- |" + " ---: |" * (len(columns) + 3),
    ]
    for workload, numbers in result["workloads"].items():
        cells = [
            f"{numbers['cost_us'][name]:+.1f} [{numbers['quartiles_us_per_step'][name][0]:.0f}-"
            f"{numbers['quartiles_us_per_step'][name][1]:.0f}]"
            for name in columns
        ]
        ratios = numbers["ratios"]
        lines.append(
            f"| {workload} | "
            + " | ".join(cells)
            + f" | {ratios['ckptlib cost / torch cost']:.3f} "
            f"| {ratios['floor cost / torch cost']:.3f} "
            f"| {ratios['ckptlib step / torch step']:.3f} |"
        )
    lines += [
        "",
        "Guards of this run (not targets):",
        "",
        *[f"- {line}" for line in guards(result)],
        "",
        "The ckptlib code one step of a plain Python function runs, counted with "
        f"`sys.setprofile`: {functions_line(result['reading_path'])}.",
        "",
    ]
    lines += [
        "",
        "Breakdown of ckptlib's cost per region (us):",
        "",
        "| workload | " + " | ".join(PARTS) + " |",
        "| --- |" + " ---: |" * len(PARTS),
    ]
    for workload, numbers in result["workloads"].items():
        lines.append(
            f"| {workload} | "
            + " | ".join(f"{v:+.1f}" for v in numbers["breakdown_us"].values())
            + " |"
        )
    return "\n".join(lines)


def write_markdown(path: Path, result: dict) -> None:
    """Replace the text between the region-cost markers in ``path`` with :func:`markdown`."""
    write_between_markers(path, MARKDOWN_BEGIN, MARKDOWN_END, markdown(result), "region-cost")


def write_between_markers(path: Path, begin: str, end: str, body: str, name: str) -> None:
    """Replace the text between the lines ``begin`` and ``end`` (the ``name`` markers) of
    ``path`` with ``body``."""
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {name} markers ({begin} ... {end}); add them where the "
                         "table should go.")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{body}\n{end}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="write the tables between the region-cost markers of this Markdown file",
    )
    parser.add_argument(
        "--from-json", type=Path, default=None, help="report a saved run instead of measuring"
    )
    args = parser.parse_args(argv)
    result = json.loads(args.from_json.read_text()) if args.from_json else measure(args.rounds)
    print(table(result))
    if args.json is not None and args.from_json is None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown is not None:
        write_markdown(args.markdown, result)


if __name__ == "__main__":
    main(sys.argv[1:])
