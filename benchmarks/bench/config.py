"""What the bench runs: the model sizes and presets (``Config``), and the variants of each group.

Three *groups* of variants; the variants of a group train the same model (same
seed, same batch) and differ only in how activations are kept:

``blocks``     a ``TinyTransformer``: plain autograd, ``torch.utils.checkpoint``
               per block (``use_reentrant=False``), ``ckptlib.checkpoint`` per
               block, ``checkpoint_sequential`` with sqrt(n) segments; plus the
               plain step under the memory meter, to measure the meter's cost
               (``METER_VARIANTS``: timed only, and reported apart).
``selective``  4 blocks, d_model 256, seq 256, batch 4: full checkpointing
               (ckptlib and torch) and selective checkpointing that keeps the
               matmul outputs (``ckptlib.selective.save_matmuls`` and PyTorch's
               ``create_selective_checkpoint_contexts`` with the same ops),
               ckptlib's Megatron-style policy (recompute only the attention core),
               and a policy chosen from one block's measured op costs
               (``policy_from_costs``, up to half of the block's activations),
               run as is and with its plans reused (``SelectivePlans``: after the
               first call, forward runs with no dispatch mode).
``offload``    saved tensors moved to CPU: ``ckptlib.offload`` and
               ``torch.autograd.graph.save_on_cpu``.

Then two sweeps that measure memory only (:mod:`benchmarks.bench.sweeps`).
``DEFAULT`` is what ``make bench`` runs, ``QUICK`` a shorter run (``--quick``),
``TINY`` a run of a few seconds for tests.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Callable, ContextManager

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ckptlib._arguments import flag, integer
from ckptlib.memory import MemoryMeter, format_bytes
from ckptlib.models import MLPChain, TinyTransformer
from ckptlib.offload import offload_saved_tensors
from ckptlib.selective import (
    SelectivePlans,
    megatron_attention,
    policy_from_costs,
    save_matmuls,
    selective_checkpoint,
)

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
METER_VARIANTS = {"peak": "plain_metered", "timeline": "plain_metered_timeline"}
"""The plain step of the ``blocks`` group under the live-tensor meter: the meter's own cost."""


@dataclass(frozen=True)
class TransformerSize:
    """A ``TinyTransformer`` and the batch it trains on."""

    depth: int
    d_model: int
    heads: int
    seq: int
    vocab: int
    batch: int

    def __post_init__(self) -> None:
        for size in fields(self):
            integer(
                getattr(self, size.name),
                size.name,
                least=1,
                where="TransformerSize",
                range_apart=True,
            )

    def build(self, device: torch.device, **overrides: Any) -> TinyTransformer:
        sizes = dict(
            depth=self.depth, d_model=self.d_model, heads=self.heads, seq=self.seq, vocab=self.vocab
        )
        return TinyTransformer(**{**sizes, **overrides}).to(device)

    def describe(self, depth: int | str | None = None) -> str:
        """``TinyTransformer(depth=8, ...), batch 8``; ``depth`` replaces the depth shown."""
        return (
            f"TinyTransformer(depth={self.depth if depth is None else depth}, "
            f"d_model={self.d_model}, heads={self.heads}, seq={self.seq}, vocab={self.vocab}), "
            f"batch {self.batch}"
        )


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
    blocks: TransformerSize = TransformerSize(
        depth=8, d_model=128, heads=4, seq=64, vocab=256, batch=8
    )
    selective: TransformerSize = TransformerSize(
        depth=4, d_model=256, heads=4, seq=256, vocab=256, batch=4
    )
    depths: tuple[int, ...] = (1, 2, 4, 8, 16)
    scaling_ns: tuple[int, ...] = (16, 32, 64, 128, 256)
    # Narrow and tall: activations (batch x width) dominate the weights (width x width).
    scaling_width: int = 32
    scaling_batch: int = 256
    clock: str = "wall"  # "wall" (time.perf_counter) or "cpu" (time.process_time); see timing.py
    quick: bool = False

    def __post_init__(self) -> None:
        """Refuse a setting the run would only fail on minutes later (or measure nothing with)."""
        integer(self.rounds, "rounds", least=1, where="Config", range_apart=True)
        for name in ("blocks", "selective"):
            if not isinstance(getattr(self, name), TransformerSize):
                raise TypeError(
                    f"Config: {name} must be a TransformerSize, got "
                    f"{type(getattr(self, name)).__name__}."
                )
        for name, least, why in (
            ("depths", 1, "the depths to sweep"),
            ("scaling_ns", 2, "a fit needs two n"),
        ):
            values = getattr(self, name)
            if not isinstance(values, (tuple, list)) or len(set(values)) < least:
                raise ValueError(
                    f"Config: {name} must be a tuple of at least {least} different ints "
                    f"({why}), got {values!r}."
                )
            for value in values:
                integer(value, f"each of {name}", least=1, where="Config", range_apart=True)
        integer(self.scaling_width, "scaling_width", least=1, where="Config", range_apart=True)
        integer(self.scaling_batch, "scaling_batch", least=1, where="Config", range_apart=True)
        if self.clock not in CLOCKS:
            raise ValueError(f"Config: clock must be one of {sorted(CLOCKS)}, got {self.clock!r}.")
        flag(self.quick, "quick", where="Config")


DEFAULT = Config()
QUICK = Config(rounds=5, depths=(1, 2, 4, 8), scaling_ns=(16, 32, 64, 128), quick=True)
TINY = Config(
    rounds=2,
    quick=True,
    blocks=TransformerSize(depth=2, d_model=16, heads=2, seq=8, vocab=32, batch=2),
    selective=TransformerSize(depth=2, d_model=16, heads=2, seq=8, vocab=32, batch=2),
    depths=(1, 2),
    scaling_ns=(4, 9, 16),
    scaling_width=4,
    scaling_batch=8,
)
"""A run of a few seconds, for tests; the numbers mean nothing at this size."""


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
    metered: str | None = None  # None, "peak" or "timeline"

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
    pairs: dict[str, tuple[str, str]] = field(
        default_factory=dict
    )  # name -> (numerator, denominator)
    tradeoffs: dict[str, str] = field(default_factory=dict)  # selective variant -> its full variant
    notes: dict[str, str] = field(
        default_factory=dict
    )  # what else a reader needs (a policy's choice)


class _RunWith(nn.Module):
    """A block run through ``runner(block, x)``: how the bench applies a checkpoint the
    models' ``checkpointing`` switch does not offer (selective policies)."""

    def __init__(
        self, block: nn.Module, runner: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.block, self.runner = block, runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner(self.block, x)


def _with_runner(
    model: TinyTransformer, runner: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> TinyTransformer:
    model.blocks = nn.Sequential(*(_RunWith(block, runner) for block in model.blocks))
    return model


def _ckptlib_selective(policy: Any, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return selective_checkpoint(block, x, policy=policy)


def _ckptlib_selective_reusing_plans(
    policy: Any, plans: SelectivePlans, block: nn.Module, x: torch.Tensor
) -> torch.Tensor:
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


def _plain(
    size: TransformerSize, device: torch.device
) -> tuple[TinyTransformer, tuple[torch.Tensor, torch.Tensor]]:
    """The model every variant of a group is compared with, and the batch they all train on."""
    plain = size.build(device)
    return plain, plain.example_batch(batch=size.batch)


def _per_block(
    size: TransformerSize,
    device: torch.device,
    plain: TinyTransformer,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> list[Variant]:
    """Plain autograd, and torch's and ckptlib's checkpoint around each block."""
    return [
        Variant("plain", "plain autograd", plain, batch),
        Variant(
            "torch",
            "torch.utils.checkpoint per block",
            size.build(device, checkpointing="torch"),
            batch,
        ),
        Variant(
            "ckptlib",
            "ckptlib.checkpoint per block",
            size.build(device, checkpointing="block"),
            batch,
        ),
    ]


def build_groups(config: Config, device: torch.device) -> list[Group]:
    size = config.blocks
    plain, batch = _plain(size, device)
    blocks = Group(
        "blocks",
        "Per-block checkpointing",
        size.describe(),
        [
            *_per_block(size, device, plain, batch),
            Variant(
                "sqrt",
                "checkpoint_sequential, sqrt(n) segments",
                size.build(device, checkpointing="sqrt"),
                batch,
            ),
            Variant(
                METER_VARIANTS["peak"],
                "plain, under the live-tensor meter",
                plain,
                batch,
                metered="peak",
            ),
            Variant(
                METER_VARIANTS["timeline"],
                "plain, meter recording a timeline",
                plain,
                batch,
                metered="timeline",
            ),
        ],
        pairs={"ckptlib_vs_torch": ("ckptlib", "torch")},
    )

    size = config.selective
    plain, batch = _plain(size, device)
    cost_policy = _cost_policy(size, device)
    selective = Group(
        "selective",
        "Selective checkpointing",
        size.describe(),
        [
            *_per_block(size, device, plain, batch),
            Variant(
                "torch_save_matmuls",
                "torch SAC, save matmuls",
                _with_runner(size.build(device), partial(_torch_selective, list(save_matmuls))),
                batch,
            ),
            Variant(
                "ckptlib_save_matmuls",
                "ckptlib selective, save matmuls",
                _with_runner(size.build(device), partial(_ckptlib_selective, save_matmuls)),
                batch,
            ),
            Variant(
                "ckptlib_megatron",
                "ckptlib selective, Megatron attention",
                _with_runner(size.build(device), partial(_ckptlib_selective, megatron_attention)),
                batch,
            ),
            Variant(
                "ckptlib_cost_policy",
                "ckptlib selective, policy from measured op costs",
                _with_runner(size.build(device), partial(_ckptlib_selective, cost_policy)),
                batch,
            ),
            Variant(
                "ckptlib_cost_policy_plans",
                "ckptlib selective, that policy, plans reused (SelectivePlans)",
                _with_runner(
                    size.build(device),
                    partial(_ckptlib_selective_reusing_plans, cost_policy, SelectivePlans()),
                ),
                batch,
            ),
        ],
        pairs={
            "ckptlib_vs_torch": ("ckptlib", "torch"),
            "ckptlib_vs_torch_save_matmuls": ("ckptlib_save_matmuls", "torch_save_matmuls"),
        },
        tradeoffs={
            "torch_save_matmuls": "torch",
            "ckptlib_save_matmuls": "ckptlib",
            "ckptlib_megatron": "ckptlib",
            "ckptlib_cost_policy": "ckptlib",
            "ckptlib_cost_policy_plans": "ckptlib",
        },
        notes={
            "cost policy keeps": ", ".join(
                f"`{call}`" for call in sorted(map(str, cost_policy.chosen))
            )
            + f" ({format_bytes(cost_policy.used_bytes)} per block)"
        },
    )

    size = config.blocks
    plain, batch = _plain(size, device)
    offload = Group(
        "offload",
        "Offloading saved tensors to CPU",
        size.describe(),
        [
            Variant("plain", "plain autograd", plain, batch),
            Variant(
                "torch_save_on_cpu",
                "torch.autograd.graph.save_on_cpu",
                size.build(device),
                batch,
                context=partial(_torch_save_on_cpu, device),
            ),
            Variant(
                "ckptlib_offload",
                "ckptlib.offload.offload_saved_tensors",
                size.build(device),
                batch,
                context=offload_saved_tensors,
            ),
        ],
        pairs={"ckptlib_vs_torch": ("ckptlib_offload", "torch_save_on_cpu")},
    )
    return [blocks, selective, offload]
