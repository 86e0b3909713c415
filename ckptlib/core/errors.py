"""What a user sees when a checkpoint goes wrong: its exceptions, and the line its warnings name."""
from __future__ import annotations

import contextlib
import os
import sys

import torch

__all__ = ["CheckpointError", "RecomputeAgain", "caller_stacklevel"]


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
