"""Capture and replay of random-number-generator state.

A checkpointed region runs twice: once in forward, once when backward needs its
activations back. If the region draws random numbers (dropout), the second run
must draw the *same* numbers, or the recomputed activations belong to a
different network than the one whose output the loss saw. So at forward we take
a snapshot of every generator the region may use, and at recomputation we run
under that snapshot inside ``torch.random.fork_rng``, which puts the caller's
generators back afterwards: recomputing never moves the caller's RNG stream.

>>> import torch
>>> state = capture([])
>>> a = torch.rand(2)
>>> with replay(state):
...     b = torch.rand(2)
>>> torch.equal(a, b)
True
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch


@dataclass(frozen=True)
class RNGState:
    """The generators' states at one moment: always the CPU one, CUDA ones if CUDA is up."""

    cpu: torch.Tensor
    cuda_devices: tuple[int, ...] = ()
    cuda_states: tuple[torch.Tensor, ...] = field(default=())


def cuda_devices_of(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """CUDA device indices a region may draw from: its inputs' devices and the current device.

    Returns ``()`` while CUDA is not initialised, so a CPU-only program never
    initialises CUDA by accident.
    """
    if not torch.cuda.is_initialized():
        return ()
    devices = {t.get_device() for t in tensors if t.is_cuda}
    devices.add(torch.cuda.current_device())
    return tuple(sorted(devices))


def capture(tensors: Iterable[torch.Tensor]) -> RNGState:
    """Snapshot the CPU generator and, when CUDA is initialised, the generators of
    the CUDA devices that ``tensors`` live on (plus the current device)."""
    devices = cuda_devices_of(tensors)
    return RNGState(
        cpu=torch.get_rng_state(),
        cuda_devices=devices,
        cuda_states=tuple(torch.cuda.get_rng_state(d) for d in devices),
    )


@contextlib.contextmanager
def replay(state: RNGState) -> Iterator[None]:
    """Run the block with the generators set to ``state``; restore the caller's afterwards."""
    with torch.random.fork_rng(devices=list(state.cuda_devices), enabled=True):
        torch.set_rng_state(state.cpu)
        for device, device_state in zip(state.cuda_devices, state.cuda_states):
            torch.cuda.set_rng_state(device_state, device)
        yield
