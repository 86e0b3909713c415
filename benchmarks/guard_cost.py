"""What the forward-vs-rerun guards cost: one checkpointed block, forward and backward.

    python benchmarks/guard_cost.py [--rounds 40] [--json benchmarks/results/guard_cost.json]
                                    [--markdown benchmarks/README.md] [--from-json FILE]

Variants, on an MLPChain block (Linear + ReLU, width 256, batch 8) and a TinyTransformer
block (d_model 128, 4 heads, seq 64, batch 8):

* plain: no checkpoint;
* torch: ``torch.utils.checkpoint(block, x, use_reentrant=False)``;
* ckptlib: ``ckptlib.checkpoint(block, x)`` as shipped;
* ckptlib, guards off: the same with the forward-vs-rerun guards switched off *in this
  script only* (monkeypatched): no producer in the saved-tensor key, no versions of what the
  region reads beyond its inputs, no state-written-twice watch, no generator registration,
  no argument checks. That is the checkpoint as it was before the guards (the one other
  addition, a ``torch.compiler.is_compiling()`` test per call, stays: about 0.1 us).

Timing: one torch thread, this process's CPU time (the machine is shared), interleaved
rounds (each round runs every variant once, in a rotating order) and the median over rounds
of the time per training step of the block, with its quartiles (the spread between rounds:
on a shared machine differences inside it are noise).
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
from typing import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckptlib
from ckptlib import guards, rng
from ckptlib.models import MLPChain, TinyTransformer

checkpoint_module = sys.modules["ckptlib.checkpoint"]


class _InputsOnly(guards.OutsideReads):
    """What the checkpoint read-checked before the guards: its inputs' versions, nothing else."""

    def __init__(self, fn, inputs) -> None:
        self.roots, self.read, self.written, self.saved_leaves = [], [], [], []
        self.inputs = [(weakref.ref(t), t._version) for t in inputs]
        self.fn, self._storages = (
            fn,
            None,
        )  # which saved tensors free memory: not a guard, kept as is

    def add_saved_leaf(self, leaf) -> None:
        pass

    def after_forward(self) -> None:
        pass

    def around_rerun(self, region):
        return contextlib.nullcontext()


@contextlib.contextmanager
def _no_generator_use(state) -> Iterator[None]:
    yield None


@contextlib.contextmanager
def guards_off() -> Iterator[Callable]:
    """The checkpoint without its forward-vs-rerun guards (see the module docstring)."""
    patches = [
        (guards, "OutsideReads", _InputsOnly),
        (
            guards,
            "saved_key",
            lambda tensor, ptr, input_ptrs: (tensor.shape, tensor.dtype, tensor.device),
        ),
        (rng, "in_use", _no_generator_use),
        (checkpoint_module, "check_checkpoint_arguments", lambda *args: None),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield checkpoint_module.checkpoint
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def blocks() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    mlp = MLPChain(depth=1, width=256)
    transformer = TinyTransformer(depth=1, d_model=128, heads=4, seq=64)
    torch.manual_seed(0)
    return {
        "MLPChain block (width 256, batch 8)": (mlp.blocks[0], torch.randn(8, 256)),
        "TinyTransformer block (d_model 128, seq 64, batch 8)": (
            transformer.blocks[0],
            torch.randn(8, 64, 128),
        ),
    }


def step(run: Callable, block: torch.nn.Module, x: torch.Tensor) -> None:
    h = x.requires_grad_()
    run(block, h).square().sum().backward()


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "plain": lambda: contextlib.nullcontext(lambda block, x: block(x)),
    "torch.utils.checkpoint": lambda: contextlib.nullcontext(
        lambda block, x: torch_checkpoint(block, x, use_reentrant=False)
    ),
    "ckptlib": lambda: contextlib.nullcontext(ckptlib.checkpoint),
    "ckptlib, guards off": guards_off,
}


def measure(rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for block_name, (block, x) in blocks().items():
        names = list(VARIANTS)
        for name in names:  # warm up
            with VARIANTS[name]() as run:
                for _ in range(3):
                    step(run, block, x)
        per_step_us: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                with VARIANTS[name]() as run:
                    began = time.process_time()
                    for _ in range(steps):
                        step(run, block, x)
                    per_step_us[name].append((time.process_time() - began) / steps * 1e6)
                block.zero_grad(set_to_none=True)
        median = {name: statistics.median(values) for name, values in per_step_us.items()}
        quartiles = {
            name: statistics.quantiles(values, n=4) for name, values in per_step_us.items()
        }
        results[block_name] = {
            "median_us_per_step": {name: round(value, 1) for name, value in median.items()},
            "quartiles_us_per_step": {
                name: [round(q[0], 1), round(q[2], 1)] for name, q in quartiles.items()
            },
            "ratios": {
                "ckptlib / ckptlib guards off": round(
                    median["ckptlib"] / median["ckptlib, guards off"], 3
                ),
                "ckptlib / torch.utils.checkpoint": round(
                    median["ckptlib"] / median["torch.utils.checkpoint"], 3
                ),
                "ckptlib guards off / torch.utils.checkpoint": round(
                    median["ckptlib, guards off"] / median["torch.utils.checkpoint"], 3
                ),
                "ckptlib / plain": round(median["ckptlib"] / median["plain"], 3),
                "torch.utils.checkpoint / plain": round(
                    median["torch.utils.checkpoint"] / median["plain"], 3
                ),
            },
            "guard_cost_us_per_step": round(median["ckptlib"] - median["ckptlib, guards off"], 1),
        }
    return {
        "schema": "ckptlib.guard_cost/1",
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": 1,
            "clock": "process CPU time",
            "rounds": rounds,
            "steps_per_round": steps,
        },
        "blocks": results,
    }


def table(result: dict) -> str:
    lines = []
    for block_name, numbers in result["blocks"].items():
        lines.append(f"{block_name}")
        for name, value in numbers["median_us_per_step"].items():
            low, high = numbers["quartiles_us_per_step"][name]
            lines.append(
                f"  {name:<24} {value:>10.1f} us per step (quartiles {low:.1f} to {high:.1f})"
            )
        for name, value in numbers["ratios"].items():
            lines.append(f"  {name:<45} {value:.3f}")
        lines.append(f"  guards cost {numbers['guard_cost_us_per_step']:.1f} us per step")
    return "\n".join(lines)


MARKDOWN_BEGIN = "<!-- guard cost: begin (written by benchmarks/guard_cost.py --markdown) -->"
MARKDOWN_END = "<!-- guard cost: end -->"


def markdown(result: dict) -> str:
    """The results as a Markdown table: per block, microseconds per step and the ratios."""
    env = result["environment"]
    lines = [
        f"torch {env['torch']}, {env['threads']} thread, {env['clock']}, {env['rounds']} "
        f"interleaved rounds of {env['steps_per_round']} steps; median us per training step of "
        "one block (quartiles over rounds in brackets).",
        "",
        "| block | plain | torch.utils.checkpoint | ckptlib | ckptlib, guards off "
        "| ckptlib / torch | ckptlib / guards off | guards cost |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for block_name, numbers in result["blocks"].items():
        cells = [
            f"{numbers['median_us_per_step'][name]:.1f} "
            f"[{numbers['quartiles_us_per_step'][name][0]:.0f}-{numbers['quartiles_us_per_step'][name][1]:.0f}]"
            for name in ("plain", "torch.utils.checkpoint", "ckptlib", "ckptlib, guards off")
        ]
        ratios = numbers["ratios"]
        lines.append(
            f"| {block_name} | "
            + " | ".join(cells)
            + f" | {ratios['ckptlib / torch.utils.checkpoint']:.3f} "
            f"| {ratios['ckptlib / ckptlib guards off']:.3f} "
            f"| {numbers['guard_cost_us_per_step']:+.1f} us |"
        )
    return "\n".join(lines)


def write_markdown(path: Path, result: dict) -> None:
    """Replace the text between the guard-cost markers in ``path`` with :func:`markdown`."""
    text = path.read_text()
    if MARKDOWN_BEGIN not in text or MARKDOWN_END not in text:
        raise SystemExit(
            f"{path} has no guard-cost markers ({MARKDOWN_BEGIN} ... {MARKDOWN_END}); add them "
            "where the table should go."
        )
    head, rest = text.split(MARKDOWN_BEGIN, 1)
    _, tail = rest.split(MARKDOWN_END, 1)
    path.write_text(f"{head}{MARKDOWN_BEGIN}\n{markdown(result)}\n{MARKDOWN_END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--steps", type=int, default=20, help="training steps per variant and round"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="write the table between the guard-cost markers of this Markdown file",
    )
    parser.add_argument(
        "--from-json", type=Path, default=None, help="report a saved run instead of measuring"
    )
    args = parser.parse_args()
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        result = measure(args.rounds, args.steps)
    print(table(result))
    if args.json is not None and args.from_json is None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown is not None:
        write_markdown(args.markdown, result)


if __name__ == "__main__":
    main()
