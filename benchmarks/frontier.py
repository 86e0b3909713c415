"""The peak/time frontier of one training step: ckptlib's step-peak plans against Hugging Face's and
torch's checkpointing, on GPT-2 and Llama built from configs.

    python benchmarks/frontier.py [--rounds 3] [--json benchmarks/results/frontier.json]
                                  [--markdown benchmarks/README.md] [--figures figures]
                                  [--from-json FILE] [--small]

GPT-2 and Llama, 6 layers of 256 features, random weights (nothing downloaded), one training step
on a batch of 2 x 256 token ids, one torch thread: about half a second a step on a CPU. Per
method, the step's peak from ckptlib's live-tensor meter (``ckptlib.measure``, the same meter for
every method) and the step's time over plain autograd's, from interleaved rounds (each round runs
every method once, in a rotating order; the median of the per-round ratios), in this process's
CPU time. The methods:

- ``plain``: no checkpointing;
- ``HF switch``: ``gradient_checkpointing_enable`` (non-reentrant ``torch.utils.checkpoint`` on
  every layer);
- ``torch every k`` (k = 1, 2, 3): ``apply_activation_checkpointing`` on every k-th layer;
- ``torch SAC matmuls``: HF's switch with torch's selective checkpoint keeping the matrix products
  (``create_selective_checkpoint_contexts``);
- ``ckptlib plan @ B``: ``plan_checkpointing(model, batch, peak_bytes=B)`` at budgets spread
  between the HF switch's peak and plain's, applied with ``apply_checkpointing``.

``torch.compile``'s activation memory budget is not run: see ``COMPILE_NOTE``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

import ckptlib
from ckptlib.apply import how_name, repeated_stacks

try:   # run as a script (python benchmarks/frontier.py) or as a module (-m benchmarks.frontier)
    from region_cost import write_between_markers
except ImportError:
    from benchmarks.region_cost import write_between_markers

BEGIN = "<!-- frontier: begin (written by benchmarks/frontier.py --markdown) -->"
END = "<!-- frontier: end -->"
BUDGET_SHARES = (0.05, 0.25, 0.45, 0.65, 0.85)   # of the way from the HF switch's peak to plain's
COMPILE_NOTE = (
    "torch.compile's activation memory budget (torch._functorch.config.activation_memory_budget) "
    "is not in the table. It compiles here: the first step of GPT-2 6x256 at a budget of 0.5 "
    "took 65 s on this machine (one thread, inductor with g++), so five budgets on two models "
    "would add some 11 minutes of compiling. But its peak cannot be measured with the meter every "
    "other row uses: the live-tensor meter is a dispatch mode, and Dynamo does not compile a "
    "frame that runs under one (it would run eagerly and measure plain autograd), so the CPU "
    "offers no peak to compare. On a GPU the allocator meter reads a compiled step, and there it "
    "is the peer to run: its min-cut partitioner chooses what to recompute over the whole graph.")


def models(small: bool) -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers   # an optional dependency: the hf extra

    transformers.logging.set_verbosity_error()
    layers, width, seq = (3, 64, 64) if small else (6, 256, 256)

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=seq,
                                         vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).train()

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                          intermediate_size=2 * width, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=seq, bos_token_id=0,
                                          eos_token_id=0)
        return transformers.LlamaForCausalLM(config).train()

    return {f"GPT-2 {layers}x{width}": gpt2, f"Llama {layers}x{width}": llama}


VOCAB, BATCH = 1024, 2


def batch(small: bool) -> dict:
    seq = 64 if small else 256
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def step(model: torch.nn.Module, inputs: dict) -> None:
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for _, module in repeated_stacks(model)]


def methods(make: Callable[[], torch.nn.Module], inputs: dict,
            small: bool) -> dict[str, tuple[torch.nn.Module, Callable]]:
    """name -> (its own model, a context manager that turns the method on for one step)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def nothing() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def hf_switch(model: torch.nn.Module, **kwargs) -> Callable:
        @contextlib.contextmanager
        def on() -> Iterator[None]:
            model.gradient_checkpointing_enable({"use_reentrant": False, **kwargs})
            try:
                yield
            finally:
                model.gradient_checkpointing_disable()
        return on

    chosen: dict[str, tuple[torch.nn.Module, Callable]] = {"plain": (make(), nothing)}
    model = make()
    chosen["HF switch"] = (model, hf_switch(model))
    for k in (1, 2, 3):
        model = make()
        every = set(map(id, layers_of(model)[::k]))
        apply_activation_checkpointing(model, check_fn=lambda m, every=every: id(m) in every)
        chosen[f"torch every {k}"] = (model, nothing)
    model = make()
    policy = functools.partial(create_selective_checkpoint_contexts,
                               list(ckptlib.save_matmuls))
    chosen["torch SAC matmuls"] = (model, hf_switch(model, context_fn=policy))
    return chosen


def peak_of(model: torch.nn.Module, on: Callable, inputs: dict) -> int:
    with on():
        peak = ckptlib.measure(lambda: step(model, inputs), timeline=False).peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


def measure(rounds: int, small: bool) -> dict:
    torch.set_num_threads(1)
    inputs = batch(small)
    result: dict = {"rounds": rounds, "threads": 1, "clock": "process CPU time", "models": {}}
    for name, make in models(small).items():
        print(f"{name}: planning", file=sys.stderr)
        chosen = methods(make, inputs, small)
        peaks = {method: peak_of(model, on, inputs) for method, (model, on) in chosen.items()}
        low, high = peaks["HF switch"], peaks["plain"]
        planned = make()
        plans = {}
        for share in BUDGET_SHARES:
            budget = int(low + share * (high - low))
            start = time.perf_counter()
            plan = ckptlib.plan_checkpointing(planned, inputs, peak_bytes=budget)
            plans[budget] = (plan, time.perf_counter() - start)
            chosen[f"ckptlib plan @ {share:.0%}"] = (
                planned, functools.partial(ckptlib.apply_checkpointing, planned, plan))
            peaks[f"ckptlib plan @ {share:.0%}"] = peak_of(*chosen[f"ckptlib plan @ {share:.0%}"],
                                                           inputs)
        print(f"{name}: timing {len(chosen)} methods x {rounds} rounds", file=sys.stderr)
        ratios = {method: [] for method in chosen}
        names = list(chosen)
        for round_index in range(rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            seconds = {}
            for method in order:
                model, on = chosen[method]
                with on():
                    start = time.process_time()
                    step(model, inputs)
                    seconds[method] = time.process_time() - start
                model.zero_grad(set_to_none=True)
            for method in names:
                ratios[method].append(seconds[method] / seconds["plain"])
            print(f"  round {round_index + 1}: plain {seconds['plain']:.2f} s", file=sys.stderr)
        result["models"][name] = {
            "methods": {method: {"peak_bytes": peaks[method],
                                 "time_ratio": statistics.median(ratios[method]),
                                 "time_ratios": ratios[method]} for method in names},
            "plans": {f"{(budget - low) / (high - low):.0%}": {
                "budget_bytes": budget, "hows": {path: how_name(how)
                                                 for path, how in plan.module_hows().items()},
                "measured_peak_bytes": plan.measured_peak_bytes, "peak_at": str(plan.peak_at),
                "planning_s": planning_s} for budget, (plan, planning_s) in plans.items()},
        }
    return result


def verdicts(model_result: dict) -> list[dict]:
    """Per ckptlib plan: its budget, whether it stays under, and the fastest peer under it."""
    methods_ = model_result["methods"]
    rows = []
    for plan_name, plan in model_result["plans"].items():
        mine = methods_[f"ckptlib plan @ {plan_name}"]
        peers = {name: m for name, m in methods_.items()
                 if not name.startswith("ckptlib") and m["peak_bytes"] <= plan["budget_bytes"]}
        fastest = min(peers, key=lambda name: peers[name]["time_ratio"]) if peers else None
        rows.append({"plan": plan_name, "budget_bytes": plan["budget_bytes"],
                     "peak_bytes": mine["peak_bytes"], "time_ratio": mine["time_ratio"],
                     "under": mine["peak_bytes"] <= plan["budget_bytes"],
                     "fastest_peer": fastest,
                     "peer_time_ratio": peers[fastest]["time_ratio"] if fastest else None,
                     "hows": plan["hows"]})
    return rows


def markdown(result: dict) -> str:
    lines = [f"One run, {result['rounds']} interleaved rounds, one thread, {result['clock']}, on "
             "a shared 2-core machine that other jobs kept busy: read the time ratios to about "
             "+-10%. Peak: ckptlib's live-tensor meter over one training step (forward, loss, "
             "backward, gradients), MiB. Time: step time over plain autograd's (median of the "
             "rounds).", ""]
    for name, model_result in result["models"].items():
        lines += [f"**{name}**", "", "| method | peak MiB | time ratio |", "| --- | ---: | ---: |"]
        for method, m in model_result["methods"].items():
            lines.append(f"| {method} | {m['peak_bytes'] / 2**20:.2f} | {m['time_ratio']:.2f} |")
        lines += ["", "| budget (share of the way from HF switch to plain) | budget MiB | "
                  "ckptlib peak MiB | ckptlib time | fastest peer under the budget | its time | "
                  "ckptlib's plan |", "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
        for row in verdicts(model_result):
            hows = _summary(row["hows"])
            peer = row["fastest_peer"] or "none"
            peer_time = f"{row['peer_time_ratio']:.2f}" if row["fastest_peer"] else "-"
            lines.append(f"| {row['plan']} | {row['budget_bytes'] / 2**20:.2f} | "
                         f"{row['peak_bytes'] / 2**20:.2f}{'' if row['under'] else ' (over)'} | "
                         f"{row['time_ratio']:.2f} | {peer} | {peer_time} | {hows} |")
        lines.append("")
    lines.append(COMPILE_NOTE)
    return "\n".join(lines)


def _summary(hows: dict) -> str:
    if not hows:
        return "nothing checkpointed"
    counts: dict[str, int] = {}
    for how in hows.values():
        counts[how] = counts.get(how, 0) + 1
    return ", ".join(f"{count} {how}" for how, count in counts.items())


def figure(result: dict, directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ckptlib import palette

    names = list(result["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        methods_ = result["models"][name]["methods"]
        plans = [(m["peak_bytes"], m["time_ratio"]) for method, m in methods_.items()
                 if method.startswith("ckptlib")]
        plans.sort()
        ax.plot([p / 2**20 for p, _ in plans], [t for _, t in plans], "-o",
                color=palette.HIGHLIGHT, label="ckptlib plans (5 budgets)")
        for method, m in methods_.items():
            if method.startswith("ckptlib"):
                continue
            ax.scatter(m["peak_bytes"] / 2**20, m["time_ratio"], color=palette.MUTED, zorder=3)
            # HF's switch and torch's every-layer wrapper land on one point: one label above,
            # one below
            below = method == "HF switch"
            ax.annotate(method, (m["peak_bytes"] / 2**20, m["time_ratio"]), fontsize=8,
                        xytext=(4, -10 if below else 4), textcoords="offset points")
        for plan in result["models"][name]["plans"].values():
            ax.axvline(plan["budget_bytes"] / 2**20, color=palette.HIGHLIGHT, alpha=0.15)
        ax.set_xlabel("peak of one training step (MiB, live-tensor meter)")
        ax.set_ylabel("step time / plain autograd's")
        ax.set_title(name)
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle("ckptlib's step-peak plans stay under each budget (faint lines) at about the "
                 "time of the fastest peer under it, or less")
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    for suffix in ("png", "svg"):
        fig.savefig(directory / f"frontier.{suffix}", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="write the tables between the frontier markers of this file")
    parser.add_argument("--figures", type=Path, default=None, help="write frontier.png/.svg here")
    parser.add_argument("--from-json", type=Path, default=None, help="report a saved run")
    parser.add_argument("--small", action="store_true", help="tiny models (a quick check)")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        result = measure(args.rounds, args.small)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    if args.markdown is not None:
        write_between_markers(args.markdown, BEGIN, END, table, "frontier")
    if args.figures is not None:
        figure(result, args.figures)
    print(table)


if __name__ == "__main__":
    main()
