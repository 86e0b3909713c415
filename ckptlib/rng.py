"""Capture and replay of random-number-generator state.

A checkpointed region runs twice: once in forward, once when backward needs its
activations back. If the region draws random numbers (dropout), the second run
must draw the *same* numbers, or the recomputed activations belong to a
different network than the one whose output the loss saw. So at forward we take
a snapshot of every generator the region may use, and at recomputation we run
under that snapshot inside ``torch.random.fork_rng``, which puts the caller's
generators back afterwards: recomputing never moves the caller's RNG stream.

Threads. There is one CPU generator per process (and one per CUDA device), shared
by all threads. A replay sets it, the region draws, ``fork_rng`` puts it back: if
another thread draws or replays in between, both runs see each other's numbers and
the recomputed dropout masks are not the forward's. ``in_use`` registers a
checkpoint's forward and rerun as users of their generators, so a checkpoint can
tell that another checkpoint in another thread used the same generator at the
same time (``in_use.overlapped``) and refuse, instead of giving wrong gradients
(``torch.utils.checkpoint`` is silent there). Draws by code outside any checkpoint
(plain dropout in another thread) do not register and cannot be seen.

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
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass(slots=True)    # not frozen: a frozen dataclass is slower to make, and two are made per call
class RNGState:
    """The generators' states at one moment: always the CPU one, CUDA ones if CUDA is up."""

    cpu: torch.Tensor
    cuda_devices: tuple[int, ...] = ()
    cuda_states: tuple[torch.Tensor, ...] = field(default=())

    @property
    def generators(self) -> frozenset:
        """Names of the generators this state covers: ``"cpu"`` and ``("cuda", index)``."""
        if not self.cuda_devices:
            return _CPU_ONLY
        return frozenset(["cpu", *(("cuda", device) for device in self.cuda_devices)])


_CPU_ONLY = frozenset(["cpu"])


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
    tensors = list(tensors) if isinstance(tensors, Iterable) and not isinstance(tensors, torch.Tensor) else None
    if tensors is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("capture: tensors must be a list (or other iterable) of tensors, e.g. the "
                        "region's inputs; pass [] to capture the CPU generator only.")
    return capture_devices(cuda_devices_of(tensors))


def capture_devices(cuda_devices: tuple[int, ...]) -> RNGState:
    """Snapshot the CPU generator and those of ``cuda_devices``."""
    return RNGState(
        cpu=torch.get_rng_state(),
        cuda_devices=cuda_devices,
        cuda_states=tuple(torch.cuda.get_rng_state(d) for d in cuda_devices),
    )


@contextlib.contextmanager
def replay(state: RNGState) -> Iterator["in_use"]:
    """Run the block with the generators set to ``state``; restore the caller's afterwards.

    Yields the block's :class:`in_use` registration (see the notes on threads).
    """
    if not isinstance(state, RNGState):
        raise TypeError(f"replay: state must be an RNGState from rng.capture(...), got {type(state).__name__}.")
    with torch.random.fork_rng(devices=list(state.cuda_devices), enabled=True), in_use(state) as use:
        torch.set_rng_state(state.cpu)
        for device, device_state in zip(state.cuda_devices, state.cuda_states):
            torch.cuda.set_rng_state(device_state, device)
        yield use


# ---------------------------------------------------------------------------
# Threads: who else used the same generator meanwhile
# ---------------------------------------------------------------------------


class in_use:
    """Context manager: register the block as a user of ``state``'s generators (``"cpu"``,
    ``("cuda", index)``); ``overlapped`` collects those another thread registered for
    while it ran. (A class, not a generator function: it runs twice per checkpoint.)"""

    __slots__ = ("generators", "thread", "overlapped")

    def __init__(self, state: RNGState) -> None:
        self.generators = state.generators
        self.thread = threading.get_ident()
        self.overlapped: set = set()

    def __enter__(self) -> "in_use":
        with _users_lock:
            for other in _users:
                shared = other.generators & self.generators
                if shared and other.thread != self.thread:
                    other.overlapped |= shared
                    self.overlapped |= shared
            _users.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _users_lock:
            _users.remove(self)


_users_lock = threading.Lock()
_users: list[in_use] = []


def drawn_from(before: RNGState, after: RNGState) -> set:
    """The generators whose state differs between two snapshots of the same devices."""
    drawn = {"cpu"} if not torch.equal(before.cpu, after.cpu) else set()
    for device, first, second in zip(before.cuda_devices, before.cuda_states, after.cuda_states):
        if not torch.equal(first, second):
            drawn.add(("cuda", device))
    return drawn
