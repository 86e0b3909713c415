"""The two dispatch modes of selective checkpointing: save the chosen ops in forward, replay or
skip them in the rerun.

Design notes
============

Two dispatch modes. ``selective_checkpoint`` is ``ckptlib.checkpoint`` with a
``context_fn`` that returns two ``TorchDispatchMode``\\ s sharing one cache
(:mod:`ckptlib.selective.cache`). A dispatch mode sees every aten op *below*
autograd (``torch.mm``, ``F.linear`` and ``x @ w`` all arrive as
``aten.mm``/``aten.addmm``):

* forward, :class:`SaveChosenOps`: run each op; if the policy says save, put
  its output in the cache; and record the op graph
  (:mod:`ckptlib.selective.opgraph`), from which the end of forward plans the
  calls the rerun may skip.
* recomputation, :class:`ReplaySavedOps`: for an op whose output is cached,
  return the cached output instead of running the op; skip the ops whose
  results nothing needs; run every other op.

Their ``__torch_dispatch__`` runs for every op: kept lean.

The policy is checked when the modes are made, not on the first op: a
collection must hold aten ops, a callable must take ``(op, *args, **kwargs)``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from ckptlib._arguments import flags
from ckptlib.core.checkpoint import Frame, Observer
from ckptlib.core.errors import CheckpointError
from ckptlib.selective.cache import OpCache, make_entry, raise_shape_mismatch
from ckptlib.selective.opgraph import OpGraph, Skip, from_template
from ckptlib.selective.ops import (
    CACHEABLE_KINDS,
    RANDOM,
    RANDOM_IN_PLACE,
    VIEW,
    inputs_of,
    is_parameter_cast,
    op_kind,
    tensors_of,
)
from ckptlib.selective.policy import Policy, PolicyAnswerError, as_predicate
from ckptlib.selective.signatures import next_node_number

# The old name: ckptlib.apply still imports it from here (it is
# ckptlib.selective.policy.as_predicate now).
_as_predicate = as_predicate


class RecomputeAgain(Exception):
    """Raised during a recomputation to have the checkpoint run the function again from the
    start, once: a result the selective rerun skipped turned out to be needed after all, and
    skipping is off for the next run. Honoured by :class:`RecomputesAgainOnRequest`."""


class RecomputesAgainOnRequest(Observer):
    """What only selective checkpointing adds to a checkpoint's recomputation, as an observer of
    it (a ``context_fn`` context that is an ``Observer`` joins the checkpoint's observers).

    * ``on_fill``: a recomputed saved tensor on the *meta* device (a skipped result) where the
      forward's was real asks :meth:`recompute_again` whether running the function again helps;
      if so it raises :class:`RecomputeAgain`.
    * ``run_recompute``: runs the recomputation, and once more on :class:`RecomputeAgain` (the
      holders filled by the first run are filled again); a third request is an error.
    """

    def recompute_again(self) -> bool:
        """Switch skipping off for the next run; may running again help? (No, here.)"""
        return False

    def on_fill(self, frame: Frame, index: int, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" and frame.keys[index][2].type != "meta" \
                and self.recompute_again():
            raise RecomputeAgain

    def run_recompute(self, frame: Frame, recompute: Callable[[], None]) -> None:
        for _ in range(2):
            try:
                return recompute()
            except RecomputeAgain:
                pass
        raise CheckpointError(f"checkpoint {frame.region}: the recompute context asked for a "
                              "second recomputation, then for a third; giving up.")


class SaveChosenOps(TorchDispatchMode, Observer):
    """Forward mode: run every op, and cache the outputs of those the policy chooses.

    As an observer of ``ckptlib.checkpoint`` (which reports the tensors it drops; torch's
    checkpoint does not), it also records the op graph, from which the end of the forward pass
    plans which calls the recomputation can skip.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # eager only: torch's dynamo-disabling wrapper costs ~5 us on every op

    def __init__(self, policy: Policy, cache: OpCache, *, skip_unneeded: bool = True) -> None:
        super().__init__()
        self.should_save = as_predicate(policy)
        self.cache = cache
        # A policy marked so (megatron_attention) is held to plain autograd's bytes before every op
        # (see the cache's notes, "Never more than plain autograd").
        cache.cap_every_op = bool(getattr(policy, "cap_every_op", False))
        self.skip_unneeded = skip_unneeded

    def before_forward(self, frame: Frame) -> None:
        """``ckptlib.checkpoint`` will report each saved tensor: start the op graph."""
        if not self.skip_unneeded:
            return None
        self.cache.graph = OpGraph()
        if self.cache.plan_sink is not None:
            self.cache.graph.packs, self.cache.sequence_log = [], []
            self.cache.graph.input_storages = self.cache.input_storages
        return None

    def on_pack(self, frame: Frame, holder: Any, tensor: torch.Tensor) -> None:
        if self.cache.graph is not None:
            self.cache.graph.note_saved(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cache = self.cache
        if cache.cap_every_op and cache.pending:
            # before this op allocates: nothing plain autograd would have freed
            cache.release_dead()
        output = func(*args, **kwargs)
        kind = op_kind(func)
        if kind == VIEW or is_parameter_cast(func, args):
            return output
        position = cache.calls[func]
        cache.calls[func] = position + 1
        if cache.sequence_log is not None:
            cache.sequence_log.append(func)
        saved = None
        if kind in CACHEABLE_KINDS and self.should_save(func, args, kwargs):
            saved = make_entry(func, kind, args, kwargs, output, cache.replay_random)
            if saved is not None:
                cache.saved.setdefault(func, {})[position] = saved
        graph = cache.graph
        if graph is not None:
            graph.record(func, position, kind, args, kwargs, output)
            # A random in-place op's private copy counts only where the cap is checked at every op.
            counted = saved is not None and (not saved.in_place or cache.cap_every_op)
            if counted and graph.calls and graph.calls[-1].key == (func, position):
                cache.note_cached((func, position), graph.calls[-1].outputs)
        return output

    def __enter__(self):
        graph = self.cache.graph
        if graph is not None and graph.packs is not None:
            graph.first_node = next_node_number()
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        self.cache.finish_forward(completed=exc_type is None)
        super().__exit__(exc_type, exc_value, traceback)
        if isinstance(exc_value, PolicyAnswerError):
            raise exc_value.error from None


class ReplaySavedOps(TorchDispatchMode, RecomputesAgainOnRequest):
    """Recomputation mode: hand back cached outputs in forward order, skip the calls whose
    results nothing needs (empty stand-ins of the right shape), run every other op.

    May be entered once per recomputation (``retain_graph=True`` backwards):
    each entry counts calls from zero again.

    If a skipped result turns out to be needed after all (the function read a skipped
    tensor's ``.device`` in Python to make a new one, so the op graph saw no dependency), an op
    that runs meets a meta tensor and fails, or a random op draws nothing on one: the mode
    switches skipping off and raises :class:`~ckptlib.RecomputeAgain`, and the
    checkpoint runs the function once more. Correct, at the price of a second rerun.
    """

    _should_skip_dynamo = SaveChosenOps._should_skip_dynamo

    def __init__(self, cache: OpCache) -> None:
        super().__init__()
        self.cache = cache
        self.calls: Counter[OpOverload] = Counter()
        self.consume = False
        self.skippable: dict[tuple[OpOverload, int], Skip] | None = None
        self.sequence: tuple[OpOverload, ...] | None = None
        self.step = 0
        self.active = False  # this entry pushed the mode (not so in passthrough)

    def __enter__(self):
        if self.cache.passthrough:
            return self  # a reused plan did not fit this call: plain rerun, no mode at all
        self.calls.clear()
        self.consume = _backward_frees_graph()
        self.skippable = self.cache.plan_for_rerun()
        self.sequence, self.step = self.cache.sequence, 0
        self.active = True
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.skippable is None:
            return self._dispatch(func, args, kwargs)
        try:
            output = self._dispatch(func, args, kwargs)
        except (RecomputeAgain, CheckpointError):
            raise
        except Exception:
            if any(t.is_meta for t in inputs_of(args, kwargs)) and self.recompute_again():
                raise RecomputeAgain from None  # it read a skipped result
            raise
        kind = op_kind(func)
        if (
            (kind is RANDOM or kind is RANDOM_IN_PLACE)
            and any(t.is_meta for t in tensors_of(output))
            and self.recompute_again()
        ):
            raise RecomputeAgain  # drew nothing: later random ops would draw other numbers
        return output

    def _dispatch(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        if op_kind(func) == VIEW or is_parameter_cast(func, args):
            return func(*args, **kwargs)
        if self.sequence is not None:
            self._check_sequence(func)
        position = self.calls[func]
        self.calls[func] = position + 1
        cache = self.cache
        if position >= cache.calls[func]:  # refused: say whether it reads a skipped result
            cache.check_position(
                func,
                position,
                read_skipped=self.skippable is not None
                and any(t.is_meta for t in inputs_of(args, kwargs)),
            )
        if self.skippable is not None:
            skip = self.skippable.get((func, position))
            if skip is not None:
                shapes = tuple([t.shape for t in inputs_of(args, kwargs)])
                if shapes != skip.input_shapes:
                    raise_shape_mismatch(
                        func, position, (args, tuple(kwargs.values())), skip.input_shapes
                    )
                return from_template(skip.template)
        if cache.dropped_shapes:
            cache.check_dropped(func, position, args)
        if func not in cache.saved:  # no call of this op was saved (or the cache is released)
            return func(*args, **kwargs)
        saved = cache.take(func, position, args, self.consume)
        if saved is None or saved.is_stale():
            return func(*args, **kwargs)
        return saved.replay(args)

    def recompute_again(self) -> bool:
        """A result this rerun skipped was needed after all:
        switch skipping off for every later rerun of this call, and say whether running the
        function again can help (only if something was skipped)."""
        if self.skippable is None:
            return False
        cache = self.cache
        cache.intact = False  # plan_for_rerun: no skipping from now on
        if cache.sequence is not None:
            cache.sequence = None  # a reused plan that skips too much: forget it
            if cache.on_mismatch is not None:
                cache.on_mismatch()
        return True

    def _check_sequence(self, func: OpOverload) -> None:
        """(a call reusing a plan) The rerun must run the ops of the call that recorded it.
        If not, the entries rebuilt from the saved tensors may belong to other calls: drop
        them all and run the function again as full checkpointing would."""
        step, sequence = self.step, self.sequence
        self.step = step + 1
        if step < len(sequence) and sequence[step] is func:
            return
        cache = self.cache
        cache.saved.clear()
        cache.passthrough = True
        cache.sequence = cache.skippable = None
        if cache.on_mismatch is not None:
            cache.on_mismatch()
        raise RecomputeAgain

    def __exit__(self, *exc_info):
        if not self.active:
            return False
        self.active = False
        if self.consume:
            self.cache.release()
        self.skippable = None
        self.sequence = None
        return super().__exit__(*exc_info)


def _backward_frees_graph() -> bool:
    """True inside a backward pass that was not asked to ``retain_graph``."""
    return (
        torch._C._current_graph_task_id() != -1
        and not torch._C._autograd._get_current_graph_task_keep_graph()
    )


def selective_contexts(
    policy: Policy, *, replay_random: bool = True, skip_unneeded: bool = True
) -> tuple[SaveChosenOps, ReplaySavedOps]:
    """A fresh ``(forward_context, recompute_context)`` pair sharing one empty cache.

    This is the ``context_fn`` protocol of ``torch.utils.checkpoint``, so the pair
    also works there: ``context_fn=functools.partial(selective_contexts, save_matmuls)``
    (without skipping unneeded ops: torch does not report what autograd saved).
    With ``ckptlib.checkpoint`` it is what :func:`selective_checkpoint` does.
    ``replay_random=False`` reruns random ops instead of replaying them (needed
    when the checkpoint does not replay the RNG state); ``skip_unneeded``: see
    :func:`selective_checkpoint`.

    >>> from ckptlib.selective import save_matmuls
    >>> forward_mode, recompute_mode = selective_contexts(save_matmuls)
    >>> forward_mode.cache is recompute_mode.cache
    True
    """
    flags("selective_contexts", replay_random=replay_random, skip_unneeded=skip_unneeded)
    cache = OpCache(replay_random)
    return SaveChosenOps(policy, cache, skip_unneeded=skip_unneeded), ReplaySavedOps(cache)
