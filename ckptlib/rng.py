"""Capture and replay of random-number-generator state.

A checkpointed region runs twice: once in forward, once when backward needs its
activations back. If the region draws random numbers (dropout), the second run
must draw the *same* numbers, or the recomputed activations belong to a
different network than the one whose output the loss saw. So at forward we take
a snapshot of every generator the region may use, and at recomputation we run
under that snapshot (:class:`replay`, which does what ``torch.random.fork_rng``
does for just these generators: it puts the caller's states back afterwards).
Recomputing never moves the caller's RNG stream.

Threads. There is one CPU generator per process (and one per CUDA device), shared
by all threads. A replay sets it, the region draws, the replay puts it back: if
another thread draws or replays in between, both runs see each other's numbers and
the recomputed dropout masks are not the forward's. :class:`ForwardRegistration` and
:class:`replay` register a checkpoint's forward and rerun as users of their generators, so a
checkpoint can tell that another checkpoint in another thread used the same generator at the
same time (their ``overlapped``) and refuse, instead of giving wrong gradients
(``torch.utils.checkpoint`` is silent there). Draws by code outside any checkpoint
(plain dropout in another thread) do not register and cannot be seen.

The caller's own generators. ``torch.rand(..., generator=g)`` draws from ``g``, not from
the global generator. A checkpoint replays such a generator too when it can find it: the
checkpoint passes :func:`capture` the generators that ``ckptlib.core.checks.reachable`` finds
from the region's function and arguments (the one walk that also tells the checks what the
region reads; its rule is in its docstring). A generator reached any other way (an attribute
of a plain object, a container nested deeper) is not replayed: the rerun draws other numbers,
silently (``torch.utils.checkpoint`` replays no caller generator at all).

Python's ``random`` and NumPy. Their generators are not torch's and are not replayed:
reading their state costs tens of microseconds (``random.getstate()`` copies 625 numbers),
too much for every call. :class:`ForeignDraws` compares it before and after the forward of
each function the first time it is checkpointed, and warns (:class:`NotReplayedRandomWarning`)
if it moved: the rerun will draw other numbers.

>>> import torch
>>> state = capture([])
>>> a = torch.rand(2)
>>> with replay(state):
...     b = torch.rand(2)
>>> torch.equal(a, b)
True
"""
from __future__ import annotations

import random
import sys
import threading
import types
import warnings
from collections.abc import Iterable
from typing import Any, Callable, NamedTuple

import torch

__all__ = ["RNGState", "capture", "snapshot", "replay", "ForwardRegistration",
           "shared_with_another_thread", "ForeignDraws", "NotReplayedRandomWarning"]


class RNGState(NamedTuple):
    """The generators' states at one moment: always the CPU one, CUDA ones if CUDA is up, and the
    caller's own generators."""

    cpu: torch.Tensor
    cuda_devices: tuple[int, ...] = ()
    cuda_states: tuple[torch.Tensor, ...] = ()
    caller_generators: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()   # (generator, state)

    def __repr__(self) -> str:
        return (f"RNGState(cpu, cuda_devices={self.cuda_devices}, "
                f"{len(self.caller_generators)} caller generator(s))")


def capture(tensors: Iterable[torch.Tensor],
            generators: Iterable[torch.Generator] = ()) -> RNGState:
    """Snapshot the CPU generator and, when CUDA is initialised, the generators of the CUDA
    devices that ``tensors`` live on and of the current device (while CUDA is not initialised,
    none: a CPU-only program never initialises CUDA by accident); also the caller's own
    ``generators``."""
    tensors = (list(tensors)
               if isinstance(tensors, Iterable) and not isinstance(tensors, torch.Tensor)
               else None)
    if tensors is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("capture: tensors must be a list (or other iterable) of tensors, e.g. the "
                        "region's inputs; pass [] to capture the CPU generator only.")
    devices = set()
    if torch.cuda.is_initialized():
        devices = {t.get_device() for t in tensors if t.is_cuda} | {torch.cuda.current_device()}
    return snapshot(tuple(sorted(devices)), generators)


def snapshot(cuda_devices: tuple[int, ...],
             generators: Iterable[torch.Generator] = ()) -> RNGState:
    """The states of the CPU generator, of those of ``cuda_devices`` and of the caller's
    ``generators``, now."""
    return RNGState(
        torch.default_generator.get_state(),
        cuda_devices,
        tuple(map(torch.cuda.get_rng_state, cuda_devices)),
        tuple([(g, g.get_state()) for g in generators]),
    )


def _set_states(state: RNGState) -> None:
    torch.default_generator.set_state(state.cpu)
    for device, device_state in zip(state.cuda_devices, state.cuda_states):
        torch.cuda.set_rng_state(device_state, device)
    for generator, generator_state in state.caller_generators:
        generator.set_state(generator_state)


# ---------------------------------------------------------------------------
# Threads: who else used the same generator meanwhile
# ---------------------------------------------------------------------------


class _Registration:
    """A block registered, while it runs, as a user of ``state``'s generators (``"cpu"``,
    ``("cuda", index)``): ``overlapped`` collects those another thread's block registered for
    meanwhile. The forward's :class:`ForwardRegistration` and the rerun's :class:`replay` are
    both one."""

    def __init__(self, state: RNGState) -> None:
        if type(state) is not RNGState:
            raise TypeError(f"{type(self).__name__}: state must be an RNGState from "
                            f"rng.capture(...), got {type(state).__name__}.")
        self.state = state
        self.generators = frozenset(["cpu", *(("cuda", device) for device in state.cuda_devices)])
        self.thread = threading.get_ident()
        self.overlapped: frozenset = frozenset()

    def __enter__(self) -> "_Registration":
        with _users_lock:
            for other in _users:
                shared = other.generators & self.generators
                if shared and other.thread != self.thread:
                    other.overlapped = other.overlapped | shared
                    self.overlapped = self.overlapped | shared
            _users.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _users_lock:
            _users.remove(self)


class ForwardRegistration(_Registration):
    """Context manager around a region's forward: registers it as a user of ``state``'s
    generators; ``overlapped`` collects those another thread registered for while it ran, and
    ``after`` is the state the forward left (read on exit, in the forward's own thread: did the
    region draw at all?)."""

    after: RNGState | None = None   # until the forward ends (a backward inside it finds none)

    def __exit__(self, *exc_info: object) -> None:
        _Registration.__exit__(self)
        self.after = snapshot(self.state.cuda_devices)


class replay(_Registration):
    """Context manager: run the block with the generators set to ``state``; put the caller's
    back afterwards (what ``torch.random.fork_rng`` does, for just these generators).

    A replay is itself registered as a user of its generators (see the notes on threads):
    ``overlapped`` says which generators another thread used while it ran.
    """

    def __enter__(self) -> "replay":
        state = self.state
        self.caller = snapshot(state.cuda_devices, tuple(g for g, _ in state.caller_generators))
        _set_states(state)
        _Registration.__enter__(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _Registration.__exit__(self)
        _set_states(self.caller)


_users_lock = threading.Lock()
_users: list = []   # the registered blocks open now, in any thread


def shared_with_another_thread(before: RNGState, after: RNGState | None,
                               overlap: set) -> str | None:
    """Why a rerun is refused when another thread's checkpoint used a generator this region draws
    from while the region's forward or its rerun ran (``overlap``); ``None`` when none did.
    Whether the region draws at all is read from the state its forward left (``after``): read
    in the forward's own thread, never from a generator another thread may be moving."""
    if after is None:   # a backward inside the forward: it has not left a state yet
        return None
    drawn = {"cpu"} if not torch.equal(before.cpu, after.cpu) else set()
    for device, first, second in zip(before.cuda_devices, before.cuda_states, after.cuda_states):
        if not torch.equal(first, second):
            drawn.add(("cuda", device))
    drawn &= overlap
    if not drawn:
        return None
    return ("another thread's checkpoint used the random number generator "
            f"({', '.join(map(str, drawn))}) while this region's forward or recomputation ran, and "
            "this region draws random numbers (dropout): the generator is shared by all threads, "
            "so the recomputation cannot replay the forward's draws and its gradients would be "
            "wrong. Run checkpointed steps that draw random numbers in one thread at a time "
            "(a lock around forward and backward), or use processes instead of threads.")


# ---------------------------------------------------------------------------
# Python's random and NumPy: not replayed, warned about
# ---------------------------------------------------------------------------


class NotReplayedRandomWarning(UserWarning):
    """A checkpointed function drew from Python's ``random`` or NumPy's global generator, which the
    recomputation does not replay."""


# id -> the code object (or module class) checked, kept alive so that its id stays its own. Keyed
# by id: a code object's hash is computed from its whole contents at every lookup, and this runs at
# every checkpoint call. It grows with the program's code, not with its calls.
_checked_functions: dict[int, Any] = {}


def _foreign_states() -> tuple[Any, Any]:
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state()[1:] if numpy is not None else None


class ForeignDraws:
    """The states of Python's ``random`` and NumPy's global generator before a forward; after it,
    :meth:`warn_if_moved` warns if either moved.

    Made for each function once, by :meth:`for_first_call`: reading both states costs about
    60 us, so later calls of the same function are not checked.
    """

    def __init__(self) -> None:
        self.before = _foreign_states()

    @staticmethod
    def for_first_call(fn: Callable[..., Any]) -> "ForeignDraws | None":
        """A ``ForeignDraws`` taken now if this is the first checkpointed call of ``fn``;
        ``None`` on later calls (nothing to check)."""
        # "The same function" across calls: a function's code (a lambda made anew in a loop has
        # one), a bound method's function, otherwise the callable's class (a module). Only real
        # functions and methods are asked, by their type: a user's callable may answer every
        # attribute (a proxy) or raise from one.
        if isinstance(fn, types.MethodType):
            fn = fn.__func__
        code = fn.__code__ if isinstance(fn, types.FunctionType) else type(fn)
        if id(code) in _checked_functions:
            return None
        _checked_functions[id(code)] = code
        return ForeignDraws()

    def warn_if_moved(self, region: str, stacklevel: int) -> None:
        """Warn if ``random`` or NumPy drew since this was made."""
        after = _foreign_states()
        moved = ["Python's `random`"] if after[0] != self.before[0] else []
        if after[1] is not None and self.before[1] is not None \
                and not _numpy_state_equal(after[1], self.before[1]):
            moved.append("NumPy's global generator (np.random)")
        if moved:
            warnings.warn(
                f"checkpoint {region}: the checkpointed function drew random numbers from "
                f"{' and '.join(moved)} in the forward pass. A checkpoint replays torch's "
                "generators in the recomputation, not Python's or NumPy's, so the rerun draws "
                "other numbers and the gradients are wrong wherever the result depends on them "
                "(torch.utils.checkpoint does the same, silently). Draw with torch instead "
                "(torch.rand, torch.randint, torch.randperm: replayed), or draw outside the "
                "checkpointed function and pass the numbers in. Checked on the first call of each "
                "function.", NotReplayedRandomWarning, stacklevel=stacklevel)


def _numpy_state_equal(first: tuple, second: tuple) -> bool:
    keys, position, *rest = first
    other_keys, other_position, *other_rest = second
    return position == other_position and rest == other_rest and bool((keys == other_keys).all())
