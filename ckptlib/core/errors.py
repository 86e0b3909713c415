"""What a user sees when a checkpoint goes wrong: its exceptions, the core's messages, the line its
warnings name. (The guards' messages are in ``guards.py`` and ``reads.py``, beside their checks.)"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

__all__ = ["CheckpointError", "RecomputeAgain", "caller_stacklevel", "unpacked_twice",
           "asked_again_twice", "saved_more", "saved_fewer", "context_swallowed",
           "cuda_initialised_inside"]


class CheckpointError(RuntimeError):
    """A checkpointed region could not give back what autograd saved in forward."""


class RecomputeAgain(Exception):
    """Raised by a recompute context (``context_fn``) to have the checkpoint run the function
    again from the start, once. Selective checkpointing raises it when a result its rerun
    skipped turns out to be needed after all, having switched skipping off for the next run.
    The checkpoint also asks for it when a recomputed saved tensor is on the *meta* device
    (a skipped result) and the recompute context has ``recompute_again() -> bool``."""


# torch, ckptlib, and contextlib (the core enters its observers' contexts through an ExitStack)
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                 os.path.dirname(os.path.dirname(__file__)) + os.sep, contextlib.__file__)


def caller_stacklevel() -> int:
    """The stacklevel of the first frame outside torch and ckptlib: the user's line, for
    warnings."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


# The core's messages (``checkpoint.py``): each names what differed and what to do.

def unpacked_twice(region: object, index: int, meta: object) -> str:
    return (f"checkpoint {region}: saved tensor #{index} ({meta}) was unpacked twice in one "
            "backward pass. Each recomputed tensor is handed out once and then released. If a "
            "custom autograd.Function reads ctx.saved_tensors more than once in backward, read it "
            "once into a local variable.")


def asked_again_twice(region: object) -> str:
    return (f"checkpoint {region}: the recompute context asked for a second recomputation, then "
            "for a third; giving up.")


def saved_more(region: object, forward_count: int, index: int, meta: object, causes: str) -> str:
    return (f"checkpoint {region}: the recomputation saved more tensors than the forward pass did "
            f"(forward saved {forward_count}; extra tensor #{index}: {meta}). {causes}")


def saved_fewer(forward_count: int, count: int, causes: str) -> str:
    return (f"the recomputation saved fewer tensors than the forward pass did (forward saved "
            f"{forward_count}, recomputation {count}). {causes}")


def context_swallowed(region: object, failure: BaseException) -> str:
    return (f"checkpoint {region}: the forward context from context_fn suppressed the exception "
            f"the checkpointed function raised ({type(failure).__name__}: {failure}), so there is "
            "no output to return. Let the context's __exit__ return None or False (do not swallow "
            "exceptions), or catch the exception inside the function.")


def cuda_initialised_inside(region: object) -> str:
    return (f"checkpoint {region}: CUDA was initialised inside the checkpointed function, so its "
            "RNG state could not be saved for the recomputation. Initialise CUDA before "
            "checkpointing (e.g. torch.cuda.init(), or move the model to the GPU first), or pass "
            "preserve_rng_state=False.")
