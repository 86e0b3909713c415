"""Walking a ``grad_fn`` graph and reading what each node saved, without recomputing anything.

The one walker of ckptlib: :func:`ckptlib.graph.autograd_graph` draws what it reads,
:func:`ckptlib.inspect.saved_tensors_report` and :func:`ckptlib.inspect.record_saved` tabulate it.

>>> import torch
>>> x = torch.randn(3, requires_grad=True)
>>> y = x.exp().sin()
>>> nodes, edges = walk([y.grad_fn])
>>> [op_name(node) for node in nodes]
['SinBackward0', 'ExpBackward0', 'AccumulateGrad']
>>> [(record.label, record.status, record.nbytes) for record in read_saved(nodes[0])]
[('self', 'kept', 12)]

Design notes
============

Walking. A tensor's ``grad_fn`` is the node that will compute its gradient;
``node.next_functions`` lists the nodes of its inputs (``None`` for an input that
needs no gradient). Leaves that receive ``.grad`` end in an ``AccumulateGrad`` node
whose ``.variable`` is the leaf. :func:`walk` goes breadth-first with an explicit
queue, so a 1000-layer chain is as easy as a 3-layer one (a recursive walk, as in
torchviz, hits Python's recursion limit), and gives the nodes in the same order in
every run: the order the graph's ids (``n0``, ``n1``, ...) and a report's rows follow.

Saved tensors. Every tensor a node keeps for backward appears as a pair of
attributes: ``node._raw_saved_<name>`` (autograd's ``SavedTensor`` box) and
``node._saved_<name>`` (the tensor, unpacked; ``saved_tensors`` for a custom
``autograd.Function``). Reading ``_saved_<name>`` calls the unpack hook of whatever
``saved_tensors_hooks`` packed it, so :func:`read_saved` reads it inside
:func:`ckptlib.peek_saved`: a tensor a ckptlib checkpoint dropped then
comes back as an empty ``meta`` tensor with its ``PackedInfo`` (region, index,
unpack count), and nothing is recomputed. ``torch.utils.checkpoint`` has no such
switch: reading would rerun its function. Its tensors are recognised before
reading, by the module of the box's ``unpack_hook``, and their shape is read from
that checkpoint's own records (torch internals; if a future torch moves them, the
shape shows as unknown, never a recomputation). A saved tensor that a backward
already freed raises ``RuntimeError`` when read: it is ``freed`` (or ``modified``
when the box still holds it: it was changed in place after saving, and that
backward would fail).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from ckptlib.core.peek import PackedInfo, peek_saved

__all__ = ["walk", "Walk", "read_saved", "SavedRecord", "op_name", "TORCH_CHECKPOINT"]

TORCH_CHECKPOINT = "torch.utils.checkpoint"
"""The region name given to tensors that ``torch.utils.checkpoint`` dropped."""


class Walk(NamedTuple):
    """The nodes reached, in breadth-first discovery order, and the edges input -> consumer."""

    nodes: list[Any]
    edges: list[tuple[Any, Any]]


def walk(roots: Sequence[Any], first: int = 0) -> Walk:
    """Breadth-first over ``next_functions`` from ``roots`` (``None`` ones skipped).

    ``first``: only nodes autograd made at or after sequence number ``first`` (a node
    older than that is neither listed nor walked through): the nodes one call made.
    """
    nodes: list[Any] = []
    seen: set[Any] = set()
    queue: deque[Any] = deque()

    def reach(node: Any) -> None:
        if node is not None and node not in seen and (not first or node._sequence_nr() >= first):
            seen.add(node)
            nodes.append(node)
            queue.append(node)

    for root in roots:
        reach(root)
    edges = []
    while queue:
        node = queue.popleft()
        for next_node, _ in node.next_functions:
            reach(next_node)
            if next_node in seen:
                edges.append((next_node, node))
    return Walk(nodes, edges)


def op_name(node: Any) -> str:
    """``"torch::autograd::AccumulateGrad"`` -> ``"AccumulateGrad"``; others as they are."""
    return node.name().rsplit("::", 1)[-1]


@dataclass(frozen=True)
class SavedRecord:
    """One tensor a node saved, as :func:`read_saved` found it (it lives as long as the walk).

    ``status`` is ``"kept"`` (autograd holds it: ``tensor`` is it), ``"dropped"`` (a
    checkpoint dropped it in forward), ``"recomputed"`` (a checkpoint recomputed it
    and a backward used it), ``"freed"`` (a backward released it) or ``"modified"``
    (changed in place after it was saved). ``shape``, ``dtype`` and ``nbytes`` are
    ``None`` when they cannot be known. ``info`` is a ckptlib checkpoint's record of a
    tensor it dropped; ``region`` names that checkpoint (:data:`TORCH_CHECKPOINT` for
    torch's). ``packed`` is what a saved-tensor pack hook stored for it (``None``
    without a hook): a hook's owner recognises its own tensors by it. ``output`` says which
    autograd output the tensor is: the node that made it and that node's output number, which
    autograd keeps with every saved tensor, a dropped one too (``None`` for a tensor without
    history, and where nothing was read). Two nodes that saved one tensor (a ReLU's result, the
    next Linear's ``mat1``) name the same output, so a total can count it once.
    """

    node: Any
    name: str  # "mat1"; "tensors" for a custom Function's ctx.save_for_backward
    attribute: str  # the attribute read: "_saved_mat1", "saved_tensors"
    count: int  # tensors in the attribute (1 for a single one)
    index: int | None  # position in a saved list; None for a single saved tensor
    status: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    nbytes: int | None
    tensor: torch.Tensor | None = None
    region: str | None = None
    info: PackedInfo | None = None
    packed: Any = None
    output: tuple[Any, int] | None = None

    @property
    def label(self) -> str:
        """``"mat1"``, or ``"tensors[0]"`` for one tensor of a saved list."""
        return self.name if self.index is None else f"{self.name}[{self.index}]"

    @property
    def frees_memory(self) -> bool:
        """For a dropped tensor: False if dropping it freed nothing (an input, a parameter, a
        view of one)."""
        return self.info.frees_memory if self.info is not None else True


def read_saved(node: Any) -> Iterator[SavedRecord]:
    """The tensors ``node`` saved, in attribute order, read without triggering any recomputation
    (see the notes above). Saved "undefined" tensors (``None``: backward will not need them) are
    left out."""
    attributes = set(dir(node))
    for raw_attribute in sorted(a for a in attributes if a.startswith("_raw_saved_")):
        name = raw_attribute[len("_raw_saved_") :]
        raw = getattr(node, raw_attribute)
        # A custom autograd.Function exposes ctx.save_for_backward as `saved_tensors`.
        attribute = f"_saved_{name}" if f"_saved_{name}" in attributes else f"saved_{name}"
        single = not isinstance(raw, (tuple, list))
        boxes = [raw] if single else list(raw)
        slots = [(None if single else i, box, _packed(box)) for i, box in enumerate(boxes)]
        at = partial(SavedRecord, node, name, attribute, len(boxes))

        if any(_packed_by_torch_checkpoint(box) for box in boxes):
            for index, box, packed in slots:
                yield _torch_checkpoint_record(at, index, box, packed)
            continue
        with peek_saved() as peek:
            try:
                value = getattr(node, attribute)
            except RuntimeError:
                for index, box, packed in slots:
                    yield _unreadable(at, index, box, packed)
                continue
            infos = [peek.take()] if single else [_peek_one(box, peek) for box in boxes]
        values = [value] if single else list(value)
        for (index, _, packed), tensor, info in zip(slots, values, infos):
            if tensor is not None:
                yield _record(at, index, tensor, info, packed)


def _packed(box: Any) -> Any:
    """What the pack hook of ``box`` stored; ``None`` for a box no hook packed."""
    return box.data if getattr(box, "unpack_hook", None) is not None else None


def _record(
    at: Callable[..., SavedRecord],
    index: int | None,
    tensor: torch.Tensor,
    info: PackedInfo | None,
    packed: Any,
) -> SavedRecord:
    output = (tensor.grad_fn, tensor.output_nr) if tensor.grad_fn is not None else None
    meta = info.meta if info is not None else None
    if meta is not None:
        status = "recomputed" if info.unpack_count > 0 else "dropped"
        # The stand-in the peek handed back carries the saved tensor's place in the graph:
        # autograd attaches its producing node and output number to whatever an unpack returns.
        return at(
            index,
            status,
            meta.shape,
            meta.dtype,
            meta.nbytes,
            region=info.region,
            info=info,
            packed=packed,
            output=output,
        )
    shape, nbytes = tuple(tensor.shape), tensor.numel() * tensor.element_size()
    if tensor.device.type == "meta":  # dropped by a hook we do not know; nothing is held
        return at(index, "dropped", shape, tensor.dtype, nbytes, packed=packed, output=output)
    return at(index, "kept", shape, tensor.dtype, nbytes, tensor, packed=packed, output=output)


def _unreadable(
    at: Callable[..., SavedRecord], index: int | None, box: Any, packed: Any
) -> SavedRecord:
    """A saved tensor that raised on reading: freed by a backward, or modified in place since."""
    data = box.data  # what autograd still holds: nothing once a backward freed it
    if data is None:
        return at(index, "freed", None, None, None, packed=packed)
    if isinstance(data, torch.Tensor):
        return at(
            index,
            "modified",
            tuple(data.shape),
            data.dtype,
            data.numel() * data.element_size(),
            packed=packed,
        )
    return at(index, "modified", None, None, None, packed=packed)


def _peek_one(box: Any, peek: Any) -> PackedInfo | None:
    """PackedInfo of one element of a saved list (``peek.take()`` only keeps the last read)."""
    if getattr(box, "unpack_hook", None) is None:
        return None
    try:
        box.unpack()
    except RuntimeError:  # a saved output cannot be unpacked on its own; no info for it
        return None
    return peek.take()


def _packed_by_torch_checkpoint(box: Any) -> bool:
    hook = getattr(box, "unpack_hook", None)
    return getattr(hook, "__module__", None) == TORCH_CHECKPOINT


def _torch_checkpoint_record(
    at: Callable[..., SavedRecord], index: int | None, box: Any, packed: Any
) -> SavedRecord:
    """A tensor torch.utils.checkpoint dropped, described from its records without unpacking it.

    The pack hook stored a ``_Holder`` (``box.data``); the frame in the hook's
    closure keeps one metadata dict per holder. These are torch internals: if
    they are not where this expects, the shape is reported as unknown.
    """
    holder = packed
    # The holder gets an entry per backward that recomputed the region.
    status = "recomputed" if getattr(holder, "handles", None) else "dropped"
    hook = box.unpack_hook
    try:
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__))
        frame = cells["frame"].cell_contents
        position = next(i for i, ref in enumerate(frame.weak_holders) if ref() is holder)
        meta = frame.x_metadatas[position]
        shape, dtype = tuple(meta["shape"]), meta["dtype"]
    except (AttributeError, KeyError, IndexError, StopIteration, TypeError):
        return at(index, status, None, None, None, region=TORCH_CHECKPOINT, packed=packed)
    return at(
        index,
        status,
        shape,
        dtype,
        torch.Size(shape).numel() * dtype.itemsize,
        region=TORCH_CHECKPOINT,
        packed=packed,
    )
