"""``saved_tensors_report()``: what autograd saved, for a function (recorded as it runs) or for
a graph that already exists (walked node by node, from its outputs).

A function is run under :func:`~ckptlib.inspect.recording.record_saved`, which names modules
and torch functions. A graph is walked from the outputs' ``grad_fn`` through
``next_functions``, reading every saved tensor the same way: both use
:mod:`ckptlib.autograd_walk`, the walker ``ckptlib.graph`` draws with. A walk cannot know
modules or functions, nor which dropped tensors were parameters (only their shape, dtype and
place in the graph were kept: such rows have kind "unknown"). A tensor two nodes saved is one
autograd output, so it is one storage; a view and its base, or a tensor without history, count
on their own, so ``dropped_bytes`` is an upper bound there. Tensors ``torch.utils.checkpoint``
dropped are recognised without unpacking them (a recomputation, for that checkpoint): "dropped"
rows of region ``torch.utils.checkpoint#0``. Tensors saved under any other hook are unpacked by that
hook.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from ckptlib._arguments import function, got
from ckptlib.autograd_walk import read_saved, walk
from ckptlib.inspect.labels import (
    attribute_label,
    check_model,
    grad_fns,
    kind_of,
    region_label,
    state_storages,
)
from ckptlib.inspect.recording import record_saved
from ckptlib.inspect.report import SavedTensor, SavedTensorsReport

__all__ = ["saved_tensors_report"]

Outputs = Union[torch.Tensor, Sequence[Any]]


def saved_tensors_report(
    outputs_or_fn: Outputs | Callable[[], Any], model: nn.Module | None = None
) -> SavedTensorsReport:
    """What autograd saved: for a function (run under :func:`record_saved`, with modules and
    functions named) or for the graph behind existing output tensors (walked node by node).

    ``outputs_or_fn``: a function to run with no arguments (``lambda: model(x)``), or a tensor
    or a list, tuple or dict of tensors (what a forward returned). ``model``: mark its
    parameters and buffers as such (a graph does not know them; a recorded function finds
    most of them through the module hooks).

    >>> import torch
    >>> from ckptlib import checkpoint
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> report = saved_tensors_report(lambda: checkpoint(lambda t: t.sin().exp(), x))
    >>> [(row.node, row.attribute, row.status) for row in report.rows]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('checkpoint', 'input', 'kept'), ('SinBackward0', 'self', 'dropped'),
     ('ExpBackward0', 'result', 'dropped')]
    >>> report.kept_bytes, report.dropped_bytes   # x is kept; sin's output was dropped
    (128, 128)
    """
    check_model(model, "saved_tensors_report")
    accepts = (
        "a function to run with no arguments (saved_tensors_report(lambda: model(x))), or the "
        "output tensor(s) of a forward pass (a tensor, or a list, tuple or dict of tensors)"
    )
    if isinstance(outputs_or_fn, nn.Module):
        raise TypeError(
            f"saved_tensors_report: outputs_or_fn is the module {type(outputs_or_fn).__name__} "
            f"itself; it must be {accepts}."
        )
    if callable(outputs_or_fn) and not isinstance(outputs_or_fn, torch.Tensor):
        function(
            outputs_or_fn, "outputs_or_fn", takes=0, accepts=accepts, where="saved_tensors_report"
        )
        with record_saved(model) as report:
            outputs = outputs_or_fn()
        del outputs  # the graph had to live until the block ended; the rows keep no tensors
        return report
    leaves, _ = tree_flatten(outputs_or_fn)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        error = ValueError if isinstance(outputs_or_fn, (list, tuple, dict)) else TypeError
        raise error(
            f"saved_tensors_report: outputs_or_fn must be {accepts}; {got(outputs_or_fn)}, "
            "which holds no tensor."
        )
    return _walk_report(
        grad_fns(outputs_or_fn), state_storages(model, recurse=True) if model is not None else {}
    )


def _walk_report(roots: Sequence[Any], state: dict[StorageWeakRef, str]) -> SavedTensorsReport:
    # Storage keys: ("storage", address) for a tensor in memory, ("dropped", ...) for one a
    # checkpoint dropped. ``refs`` holds a weak reference to every storage seen, so no
    # address can be reused by a new storage during the walk.
    labels: dict[tuple, str] = {}
    refs: list[StorageWeakRef] = []
    regions: dict[str, str] = {}
    rows = []
    for node in walk(roots).nodes:
        for record in read_saved(node):
            label = attribute_label(record)
            if record.status in ("freed", "modified") or record.shape is None:
                # Nothing held (or backward would fail); or torch's records moved: nothing known.
                continue
            if record.status != "kept":
                # Dropped by a checkpoint: its metadata is known, and which autograd output it
                # is (one storage for every node that saved it), not whether it was a
                # parameter: kind "unknown".
                info = record.info
                key = (("dropped", *record.output) if record.output is not None
                       else ("dropped", info.region, info.index) if info
                       else ("dropped", len(rows)))
                storage_bytes, kind, status = record.nbytes, "unknown", "dropped"
                region = region_label(regions, record.region) if record.region else ""
            else:
                storage = record.tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                refs.append(ref)
                key = ("storage", ref.cdata)
                storage_bytes, kind = storage.nbytes(), state.get(ref, kind_of(record.tensor))
                status, region = "kept", ""
            rows.append(
                SavedTensor(
                    "",
                    "",
                    node.name(),
                    label,
                    record.shape,
                    record.dtype,
                    record.nbytes,
                    labels.setdefault(key, f"s{len(labels)}"),
                    storage_bytes,
                    kind,
                    status,
                    region,
                )
            )
    return SavedTensorsReport(rows)
