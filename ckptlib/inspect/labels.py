"""What both ways of looking call what they find: a saved tensor's kind (activation, parameter,
buffer), its attribute and its region, numbered per report so a printed report is the same in
every run; and where a walk from some outputs starts.

Reading the saved tensors themselves is :mod:`ckptlib.autograd_walk`'s, shared with
:mod:`ckptlib.graph`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from ckptlib._arguments import got
from ckptlib.autograd_walk import SavedRecord

__all__ = [
    "grad_fns",
    "kind_of",
    "state_storages",
    "region_label",
    "attribute_label",
    "check_model",
]


def grad_fns(value: Any) -> list[Any]:
    """The ``grad_fn`` of each tensor in ``value`` (a tensor, or a list, tuple or dict of them)."""
    leaves, _ = tree_flatten(value)
    return [
        leaf.grad_fn
        for leaf in leaves
        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None
    ]


def kind_of(tensor: torch.Tensor) -> str:
    """``"parameter"`` for an ``nn.Parameter`` or a view of one, else ``"activation"``."""
    base = tensor._base if tensor._base is not None else tensor
    return "parameter" if isinstance(base, nn.Parameter) else "activation"


def state_storages(module: nn.Module, recurse: bool) -> dict[StorageWeakRef, str]:
    """The storages of ``module``'s parameters and buffers -> ``"parameter"`` / ``"buffer"``."""
    state = {
        StorageWeakRef(buffer.untyped_storage()): "buffer"
        for buffer in module.buffers(recurse=recurse)
    }
    state.update(
        (StorageWeakRef(p.untyped_storage()), "parameter")
        for p in module.parameters(recurse=recurse)
    )
    return state


def region_label(labels: dict[Any, str], region: Any) -> str:
    """``"Sequential@17"`` -> ``"Sequential#0"``: ckptlib numbers regions process-wide, a report
    numbers them per name in order of appearance, so printed reports are reproducible."""
    if region not in labels:
        name = getattr(region, "name", region)   # a RegionId, or a label such as torch's checkpoint
        labels[region] = (
            f"{name}#{sum(label.rsplit('#', 1)[0] == name for label in labels.values())}"
        )
    return labels[region]


def attribute_label(record: SavedRecord) -> str:
    """The attribute a row names: ``"mat1"``, ``"saved_tensors"``, ``"tensors[1]"`` in a list
    of several."""
    label = record.attribute.removeprefix("_saved_")
    return f"{label}[{record.index}]" if record.count > 1 else label


def check_model(model: Any, where: str) -> None:
    """Refuse a ``model`` argument that is neither an ``nn.Module`` nor None."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"{where}: model must be an nn.Module (its parameters and buffers are marked as such) "
            f"or None, {got(model)}."
        )
