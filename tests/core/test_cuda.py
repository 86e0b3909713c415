"""The CUDA paths that the CPU suite cannot reach: RNG replay, the dashboard, bitwise gradients.

Skipped without a GPU; ``benchmarks/gpu_check.sh`` runs them (``pytest -k cuda``) on a GPU
machine. Each test name says ``cuda`` so that selection finds them, with the older CUDA tests
in memory/test_memory.py, models/test_models.py and core/test_offload.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckptlib
from ckptlib.models import TinyTransformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _dropout_block(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.3), nn.Linear(64, 64)).to(
        device
    )


def _grads(block: nn.Module, x: torch.Tensor, how: str) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.cuda.manual_seed(1234)
    if how == "plain":
        out = block(x)
    elif how == "ckptlib":
        out = ckptlib.checkpoint(block, x)
    else:
        out = torch_checkpoint(block, x, use_reentrant=False)
    out.square().sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


def test_cuda_dropout_replay_matches_plain_and_torch():
    block = _dropout_block("cuda")
    x = torch.randn(32, 64, device="cuda")
    plain, ours, theirs = (_grads(block, x, how) for how in ("plain", "ckptlib", "torch"))
    for a, b, c in zip(plain, ours, theirs):
        assert torch.equal(b, c), "ckptlib and torch.utils.checkpoint rerun the same kernels"
        assert torch.equal(a, b), "the rerun must draw the same dropout mask as the forward"


def test_cuda_rng_state_after_backward_is_as_without_checkpoint():
    block = _dropout_block("cuda")
    x = torch.randn(32, 64, device="cuda")
    states = []
    for how in ("plain", "ckptlib"):
        _grads(block, x, how)
        states.append(torch.cuda.get_rng_state())
    assert torch.equal(states[0], states[1]), (
        "replaying the forward's RNG must not move the generator"
    )


def test_cuda_dashboard_off_and_per_block():
    from ckptlib.widgets import MemoryDashboard

    dashboard = MemoryDashboard(device="cuda", depth=4, batch=4)
    off = dashboard.run(steps=1)[-1]
    dashboard.checkpointing.value = True
    per_block = dashboard.run(steps=1)[-1]
    assert off["device"].startswith("cuda") and per_block["device"].startswith("cuda")
    assert 0 < per_block["peak_bytes"] < off["peak_bytes"]
    assert {entry.phase for entry in dashboard.timeline_data} >= {
        "forward",
        "backward",
        "recompute",
    }
    assert dashboard.plot.value, "the plot must have been drawn"


def test_cuda_transformer_checkpoint_saves_memory_on_the_allocator():
    model = TinyTransformer(depth=4).cuda()
    batch = model.example_batch()
    model.training_step(batch)
    peaks = {}
    for mode in ("none", "block"):
        model.checkpointing = mode
        peaks[mode] = ckptlib.memory.measure(
            lambda: model.training_step(batch), device="cuda"
        ).peak_bytes
    assert peaks["block"] < peaks["none"]
