"""ckptlib on Hugging Face models built from configs: every variant against plain and HF's switch.

    python benchmarks/hf_models.py [--rounds 7] [--json benchmarks/results/hf_models.json]
                                   [--markdown benchmarks/README.md] [--from-json FILE]

GPT-2 (4 layers, n_embd 128, dropout on) and Llama (4 layers, hidden 128), random weights,
nothing downloaded, one training step on a batch of 4 x 64 token ids with a padding mask. Per
model and variant: loss and gradients bitwise equal to no checkpointing and to Hugging Face's
own switch (``activation_checkpointing_enable``, non-reentrant); the peak of the live-storage
meter (``ckptlib.measure``) over the step; and the step time over HF's, from interleaved rounds
(each round runs every variant once, in a rotating order; median and quartiles of the ratio per
round), one torch thread, this process's CPU time. ``torch SAC save_matmuls`` is HF's switch
with torch's own selective checkpoint keeping the ops ``ckptlib.save_matmuls`` keeps: the
reference for the selective variants. The budget planner (``plan_checkpointing``) is run twice
per budget to show it picks the same plan.
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
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ckptlib

try:   # run as a script (python benchmarks/hf_models.py) or as a module (-m benchmarks.hf_models)
    from region_cost import write_between_markers
except ImportError:
    from benchmarks.region_cost import write_between_markers

VOCAB, BATCH, SEQ = 256, 4, 64


def models() -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers   # an optional dependency: the hf extra

    transformers.logging.set_verbosity_error()

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=SEQ,
                                         vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).train()

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128,
                                          intermediate_size=256, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=SEQ, bos_token_id=0,
                                          eos_token_id=0)
        return transformers.LlamaForCausalLM(config).train()

    return {"GPT-2 4x128": gpt2, "Llama 4x128": llama}


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :9] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids, "use_cache": False}


def step(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)   # the same dropout masks every time
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def bitwise(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(
        torch.equal(a[1][name], b[1][name]) for name in a[1])


def variants(model: torch.nn.Module, inputs: dict, budgets: list[int]) -> dict:
    """name -> a context manager that sets the model up for that variant (and undoes it)."""

    @contextlib.contextmanager
    def hf_switch(**kwargs) -> Iterator[None]:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False, **kwargs})
        try:
            yield
        finally:
            model.activation_checkpointing_disable()

    # torch's own selective checkpoint with the same ops kept: the reference for ckptlib's
    torch_save_matmuls = functools.partial(create_selective_checkpoint_contexts,
                                           list(ckptlib.save_matmuls))

    def applied(**kwargs):
        return lambda: ckptlib.apply_checkpointing(model, **kwargs)

    table = {
        "none": contextlib.nullcontext,
        "HF switch": hf_switch,
        "ckptlib full": applied(),
        "ckptlib every 2nd": applied(every_n=2),
        "ckptlib save_matmuls": applied(how=ckptlib.save_matmuls),
        "torch SAC save_matmuls": lambda: hf_switch(context_fn=torch_save_matmuls),
        "ckptlib megatron_attention": applied(how=ckptlib.megatron_attention),
        "ckptlib offload": applied(how="offload"),
    }
    for budget in budgets:
        plan = ckptlib.plan_checkpointing(model, inputs, budget_bytes=budget)
        table[f"planner {budget / 2**20:.1f} MiB"] = (lambda p=plan: ckptlib.apply_checkpointing(
            model, p))
    return table


def measure(rounds: int) -> dict:
    torch.set_num_threads(1)
    inputs = batch()
    results = {}
    for model_name, make in models().items():
        model = make()
        saved = ckptlib.plan_checkpointing(model, inputs, budget_bytes=2**62).saved_bytes
        budgets = [saved * 3 // 4, saved // 2]
        plans = {budget: [ckptlib.plan_checkpointing(model, inputs, budget_bytes=budget)
                          .module_paths() for _ in range(2)] for budget in budgets}
        table = variants(model, inputs, budgets)
        plain = step(model, inputs)
        plain = (plain[0], {n: g.clone() for n, g in plain[1].items()})
        with table["HF switch"]():
            hf = step(model, inputs)
            hf = (hf[0], {n: g.clone() for n, g in hf[1].items()})
        rows = {}
        for name, setup in table.items():
            with setup():
                got = step(model, inputs)
                peak = ckptlib.measure(lambda: step(model, inputs), timeline=False).peak_bytes
            rows[name] = {"bitwise_vs_none": bitwise(plain, got), "bitwise_vs_hf": bitwise(hf, got),
                          "peak_bytes": int(peak)}
        times: dict[str, list[float]] = {name: [] for name in table}
        names = list(table)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                with table[name]():
                    step(model, inputs)   # warm
                    began = time.process_time()
                    step(model, inputs)
                    times[name].append(time.process_time() - began)
        for name in names:
            ratios = [t / h for t, h in zip(times[name], times["HF switch"])]
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            rows[name]["time_vs_hf"] = round(statistics.median(ratios), 3)
            rows[name]["time_vs_hf_quartiles"] = [round(quartiles[0], 3), round(quartiles[2], 3)]
        results[model_name] = {
            "saved_bytes_plain": saved, "variants": rows,
            "planner": {str(budget): {"run 1": list(first), "run 2": list(second),
                                      "same": first == second}
                        for budget, (first, second) in plans.items()},
        }
    return {"schema": "ckptlib.hf_models/1", "torch": torch.__version__, "rounds": rounds,
            "threads": 1, "clock": "process CPU time", "batch": [BATCH, SEQ], "models": results}


MARKDOWN_BEGIN = "<!-- hf models: begin (written by benchmarks/hf_models.py --markdown) -->"
MARKDOWN_END = "<!-- hf models: end -->"


def markdown(result: dict) -> str:
    """One table per model (bitwise equalities, peak and time over HF's switch) and the modules
    the planner chose in its two runs; printed, and written between the markers."""
    parts = [f"torch {result['torch']}, {result['threads']} thread, {result['clock']}, "
             f"{result['rounds']} interleaved rounds, batch {result['batch'][0]} x "
             f"{result['batch'][1]} tokens.", ""]
    for model_name, numbers in result["models"].items():
        parts += [f"**{model_name}** (plain autograd saves "
                  f"{numbers['saved_bytes_plain'] / 2**20:.1f} MiB)", "",
                  "| variant | = none | = HF | peak MiB | time / HF (median) | quartiles |",
                  "|---|---|---|---:|---:|---|"]
        for name, row in numbers["variants"].items():
            low, high = row["time_vs_hf_quartiles"]
            parts.append(f"| {name} | {'yes' if row['bitwise_vs_none'] else '**no**'} | "
                         f"{'yes' if row['bitwise_vs_hf'] else '**no**'} | "
                         f"{row['peak_bytes'] / 2**20:.2f} | {row['time_vs_hf']:.2f} | "
                         f"{low:.2f} to {high:.2f} |")
        parts.append("")
        for budget, plan in numbers["planner"].items():
            second = "the same" if plan["same"] else "**other**: " + ", ".join(plan["run 2"])
            parts.append(f"- planner {int(budget) / 2**20:.1f} MiB chose "
                         f"{', '.join(plan['run 1'])}; run 2 {second}")
        parts.append("")
    return "\n".join(parts).rstrip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="write the tables between the hf-models markers of this Markdown file")
    parser.add_argument("--from-json", type=Path, default=None, help="report a saved run")
    args = parser.parse_args(argv)
    result = json.loads(args.from_json.read_text()) if args.from_json else measure(args.rounds)
    print(markdown(result))
    if args.json is not None and args.from_json is None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown is not None:
        write_between_markers(args.markdown, MARKDOWN_BEGIN, MARKDOWN_END, markdown(result),
                              "hf-models")


if __name__ == "__main__":
    main(sys.argv[1:])
