"""What ``BackwardStepper`` runs, and what watches it run: the step, the observers, the slots.

``make_step(model_or_fn, inputs, batch, kwargs)`` says how to run one training step (a
:class:`Step`); :class:`Recorder` observes one pass of it as raw :class:`Item` s, and
:func:`find_slots` reads from the graph after forward which node keeps which saved tensor.
``ckptlib.widgets._replay`` turns them into the frames the stepper shows.

Design notes
============

What runs. A demo model (``MLPChain``, ``TinyTransformer``) runs ``model.loss`` on its own
``example_batch`` under its own ``checkpointing`` switch. Any other module runs on the inputs
given (a Hugging Face model without inputs: token ids of its vocabulary, its labels the
same ids), with its repeated layers checkpointed by :func:`ckptlib.apply_checkpointing` (the
module itself when it has none) for the length of each call: the regions are named by
module path (``transformer.h.0``) and every module has its own ``forward`` back after the
call. A function runs as it is: it calls ``ckptlib.checkpoint`` itself.

What is observed. The step runs under three observers, none of which allocates or keeps
a tensor:

* the live-tensor meter (:class:`ckptlib.memory.MemoryMeter`, counting storages): after
  every aten op, the op, its phase and the bytes alive;
* :func:`ckptlib.record_trace`: what each checkpoint does (pack,
  forward_done, recompute, early_stop, unpack, release), handed to ``on_event`` as it
  happens, so each event is stamped with the ops run so far and the bytes alive then;
* a ``saved_tensors_hooks`` pair, the outermost one, for what autograd saves outside
  checkpoints (and for the inputs a checkpoint keeps, which it saves through the hook
  around it). Pack stores ``tensor.detach()``: the same memory, without the link from a
  saved output to its own ``grad_fn`` (the reference cycle of notebook 02). A weak
  reference to that stored tensor tells when autograd released it.

A release is stamped at the next thing that happens (a hook call, a trace event, or an
op, read just *before* it by a small dispatch mode): its bytes are gone by then and the
next op's are not yet there. Memory only grows inside an op and every op gets a frame,
so the largest ``live_bytes`` of all frames is the meter's peak.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ckptlib.apply import apply_checkpointing, repeated_layers
from ckptlib.core.checkpoint import is_recomputing
from ckptlib.core.peek import peek_saved
from ckptlib.core.errors import RegionId
from ckptlib.core.trace import TraceEvent
from ckptlib.graph import AutogradGraph, trace_modules
from ckptlib.autograd_walk import walk as walk_nodes
from ckptlib.memory import MemoryMeter, TimelineEntry
from ckptlib.core.checks import storage_ptr, storage_ptrs

__all__ = ["Step", "make_step", "Item", "BeforeOp", "Recorder", "recorder_hooks", "Slot",
           "GraphFacts", "find_slots", "trace_modules_of"]


@dataclass(frozen=True)
class Step:
    """How to run the step being replayed."""

    forward: Callable[[], torch.Tensor]   # makes the scalar loss
    prepare: Callable[[], None]           # resets gradients, so each pass allocates them afresh
    params: Any
    model: torch.nn.Module | None
    device: torch.device
    block_regions: bool                   # name checkpoint regions "block 0", "block 1", ...
    inputs: tuple[torch.Tensor, ...] = ()  # made before the step (the batch, fn's inputs)



# ---------------------------------------------------------------------------
# Observing a pass: everything that happens, in order, as raw items
# ---------------------------------------------------------------------------


@dataclass
class Item:
    """One thing that happened: an op, a trace event, or a pack/unpack/release of the outer hook."""

    kind: str                  # "op", "trace", "pack", "unpack", "release"
    ops: int                   # ops completed at that moment (for an op: itself included)
    live: int | None           # bytes alive then (a release gets it at the next reading)
    before: int | None = None  # for an op: bytes alive just before it ran
    op: str | None = None
    phase: str | None = None
    event: TraceEvent | None = None
    order: int | None = None   # the outer hook's pack number
    meta: tuple | None = None  # (shape, dtype, nbytes) of an outer pack
    recomputing: bool = False
    made_before: bool = False  # an outer pack of memory made before the step (its input)


class BeforeOp(TorchDispatchMode):
    """Calls back before every aten op (entered inside the meter, so it runs first)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        super().__init__()
        self.callback = callback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.callback()
        return func(*args, **(kwargs or {}))


class Recorder:
    """The observers of one pass; appends an :class:`Item` for everything it sees."""

    def __init__(self, inputs: tuple[torch.Tensor, ...] = ()) -> None:
        self.items: list[Item] = []
        self.ops = 0
        self.meter: MemoryMeter | None = None
        self.live_before_op = 0
        # The step's inputs were made before it: the meter never counts their memory.
        self._input_storages = storage_ptrs(inputs)
        self.quiet = False          # while the graph is walked: its reads are not events
        self._detaching = False     # our own detach in pack is not an op of the step
        self._orders = 0
        self._order_of: dict[int, int] = {}       # id(stored tensor) -> pack number
        self._refs: dict[int, weakref.ref] = {}   # pack number -> weakly, the stored tensor
        self._pending: list[Item] = []

    def reading(self) -> int:
        live = self.meter.live_bytes if self.meter is not None else 0
        for item in self._pending:
            item.live = live
        self._pending.clear()
        return live

    def add(self, item: Item) -> None:
        if not self.quiet:
            self.items.append(item)

    # -- the meter and the dispatch mode ---------------------------------------
    def on_op(self, entry: TimelineEntry) -> None:
        if self._detaching or self.quiet:
            return
        self.ops += 1
        self.add(Item("op", self.ops, entry.live_bytes, op=entry.op, phase=entry.phase,
                       before=self.live_before_op))

    def before_op(self) -> None:
        self.live_before_op = self.reading()

    # -- the trace ------------------------------------------------------------------
    def on_event(self, event: TraceEvent) -> None:
        self.add(Item("trace", self.ops, self.reading(), event=event, recomputing=is_recomputing()))

    # -- the outer saved-tensor hooks -------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._detaching = True
        try:
            stored = tensor.detach()
        finally:
            self._detaching = False
        order, self._orders = self._orders, self._orders + 1
        key = id(stored)
        self._order_of[key] = order
        self._refs[order] = weakref.ref(stored, lambda _ref: self._released(order, key))
        meta = (tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size())
        self.add(Item("pack", self.ops, self.reading(), order=order, meta=meta,
                       made_before=storage_ptr(tensor) in self._input_storages))
        return stored

    def unpack(self, stored: torch.Tensor) -> torch.Tensor:
        self.add(Item("unpack", self.ops, self.reading(), order=self._order_of[id(stored)]))
        return stored

    def order_of(self, stored: Any) -> int | None:
        return self._order_of.get(id(stored))

    def _released(self, order: int, key: int) -> None:
        self._order_of.pop(key, None)
        self._refs.pop(order, None)
        item = Item("release", self.ops, None, order=order)
        self.add(item)
        self._pending.append(item)


def recorder_hooks(recorder: Recorder):
    return torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)


# ---------------------------------------------------------------------------
# The graph pass: which node holds which saved tensor
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where a saved tensor sits in the graph: node id, attribute name (as ``autograd_graph``
    names them)."""

    node_id: str
    name: str
    node_op: str
    module: str | None


@dataclass
class GraphFacts:
    """What the graph pass reads from autograd's nodes besides the saved tensors."""

    sequence: dict[str, int]      # node id -> autograd's creation number (forward order)
    leaves: list[torch.Tensor]    # the leaves the step reaches: .grad reset before each pass


def find_slots(loss: torch.Tensor, recorder: Recorder, graph: AutogradGraph
           ) -> tuple[dict[int, Slot], dict[tuple[RegionId, int], Slot], GraphFacts]:
    """Outer pack number -> slot, and (region, index) -> slot, read without recomputing;
    with each node's creation number, which tells when forward made it."""
    by_order: dict[int, Slot] = {}
    by_region: dict[tuple[RegionId, int], Slot] = {}
    facts = GraphFacts({}, [])
    for number, fn in enumerate(walk_nodes([loss.grad_fn])[0]):  # the walk that numbers n0, n1, ...
        node = graph[f"n{number}"]
        if node.op != fn.name().rsplit("::", 1)[-1]:  # pragma: no cover - autograd_graph changed
            raise RuntimeError(f"BackwardStepper: node n{number} is {node.op} in autograd_graph "
                               f"but {fn.name()} in the stepper's walk; the two walks must agree.")
        facts.sequence[node.id] = fn._sequence_nr()
        if hasattr(fn, "variable"):   # AccumulateGrad: a leaf that gets .grad
            facts.leaves.append(fn.variable)
        for raw_attribute in sorted(a for a in dir(fn) if a.startswith("_raw_saved_")):
            name = raw_attribute[len("_raw_saved_"):]
            raw = getattr(fn, raw_attribute)
            boxes = list(raw) if isinstance(raw, (tuple, list)) else [raw]
            for position, box in enumerate(boxes):
                label = name if not isinstance(raw, (tuple, list)) else f"{name}[{position}]"
                slot = Slot(node.id, label, node.op, node.module)
                order = recorder.order_of(box.data)
                if order is not None:
                    by_order[order] = slot
                    continue
                with peek_saved() as peek:
                    try:
                        getattr(fn, f"_saved_{name}") if len(boxes) == 1 else box.unpack()
                    except RuntimeError:
                        continue
                    info = peek.take()
                if info is not None:
                    by_region[(info.region, info.index)] = slot
    return by_order, by_region, facts


# ---------------------------------------------------------------------------
# What to run
# ---------------------------------------------------------------------------


def make_step(model_or_fn: Any, inputs: tuple, batch: int, kwargs: dict[str, Any] | None = None
              ) -> Step:
    """The step ``BackwardStepper(model_or_fn, *inputs, batch=batch, **kwargs)`` replays."""
    kwargs = kwargs or {}
    if isinstance(model_or_fn, torch.nn.Module):
        model = model_or_fn
        if not inputs and not kwargs and _is_demo_model(model):
            return _demo_step(model, batch)
        if not inputs and not kwargs:
            if not _is_hugging_face(model):
                missing = [name for name in _DEMO_MODEL if not hasattr(model, name)]
                raise TypeError(
                    f"BackwardStepper(model): {type(model).__name__} has no {', '.join(missing)}; "
                    "pass a ckptlib demo model (MLPChain, TinyTransformer), a Hugging Face model, "
                    "a module and its inputs: BackwardStepper(layer, hidden, **kwargs) replays "
                    "layer(hidden, **kwargs).sum().backward() with the module's repeated layers "
                    "checkpointed, or a function and its inputs: BackwardStepper(fn, x) replays "
                    "fn(x).sum().backward().")
            kwargs = _hugging_face_batch(model, _batch_size(batch))
        return _module_step(model, inputs, kwargs)
    if not callable(model_or_fn):
        raise TypeError(f"BackwardStepper: expected a demo model or a function, got "
                        f"{type(model_or_fn).__name__}.")
    return _function_step(model_or_fn, inputs, kwargs)


_DEMO_MODEL = ("loss", "example_batch", "checkpointing")   # what a ckptlib demo model has


def _is_demo_model(model: torch.nn.Module) -> bool:
    return all(hasattr(model, name) for name in _DEMO_MODEL)


def _is_hugging_face(model: torch.nn.Module) -> bool:
    """A ``transformers`` model (``PreTrainedModel``), known without importing transformers."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
               for cls in type(model).__mro__)


def _batch_size(batch: Any) -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}.")
    return batch


def _demo_step(model: torch.nn.Module, batch: int) -> Step:
    if model.checkpointing == "torch":
        raise ValueError(
            "BackwardStepper follows ckptlib.checkpoint's trace; checkpointing='torch' is "
            "torch.utils.checkpoint, which has no trace. Use 'block' (the same schedule with "
            "ckptlib.checkpoint), 'none', 'sqrt', 'selective' or a Plan.")
    data = model.example_batch(batch=_batch_size(batch))
    return Step(lambda: model.loss(data), lambda: model.zero_grad(set_to_none=True), None, model,
                next(model.parameters()).device, getattr(model, "blocks", None) is not None
                and model.checkpointing == "block",
                tuple(t for t in data if isinstance(t, torch.Tensor)))


def _hugging_face_batch(model: torch.nn.Module, batch: int) -> dict[str, Any]:
    """Token ids for a Hugging Face model: ``batch`` rows of 8 (fewer if its positions are fewer),
    the same every time; its own labels where the model takes them (its loss is the step's)."""
    config = model.config
    positions = (getattr(config, "n_positions", None)
                 or getattr(config, "max_position_embeddings", None) or 8)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, min(8, positions)), generator=generator)
    ids = ids.to(next(model.parameters()).device)
    accepts = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {"input_ids": ids}
    if "labels" in accepts:
        kwargs["labels"] = ids
    if "use_cache" in accepts:
        kwargs["use_cache"] = False   # training: a cache would only be dropped by the checkpoints
    return kwargs


def _module_step(module: torch.nn.Module, inputs: tuple, kwargs: dict[str, Any]) -> Step:
    """``module(*inputs, **kwargs)``, its repeated layers (else the module itself) checkpointed by
    ``apply_checkpointing`` for the call and restored after it; a demo model keeps its own
    switch."""
    select = None if repeated_layers(module) else (lambda path, _module: path == "")
    checkpointing = contextlib.nullcontext if _is_demo_model(module) else \
        (lambda: apply_checkpointing(module, select))

    def run(*args: Any, **keywords: Any) -> Any:
        with checkpointing():
            return _loss_or_first_tensor(module(*args, **keywords))

    step = _function_step(run, inputs, kwargs)
    named = {**dict(module.named_parameters()), **dict(module.named_buffers()), **step.params}
    device = next(module.parameters(), None)
    return replace(step, params=named, model=module,
                   prepare=lambda: (module.zero_grad(set_to_none=True), step.prepare()),
                   device=device.device if device is not None else step.device)


def _loss_or_first_tensor(output: Any) -> Any:
    """What a module's output is summed from: its ``loss`` (a Hugging Face output with labels),
    else the first tensor of a tuple or a Hugging Face output; a tensor is itself."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = list(output.values()) if isinstance(output, Mapping) else output
    if isinstance(values, (tuple, list)):
        return next((value for value in values if isinstance(value, torch.Tensor)), output)
    return output


def _function_step(fn: Callable[..., Any], inputs: tuple, kwargs: dict[str, Any]) -> Step:
    # Inputs may be nested (a dict of tensors, a list of them) and need not require grad (token
    # ids): a step has a backward as soon as its output does, through an input or a parameter.
    tensors = [t for t in tree_leaves((inputs, kwargs)) if isinstance(t, torch.Tensor)]

    def forward() -> torch.Tensor:
        out = fn(*inputs, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"BackwardStepper: fn returned {type(out).__name__}; it must return a "
                            "tensor computed from the inputs (its .sum() is the loss).")
        if not out.requires_grad:
            raise ValueError("BackwardStepper(fn, *inputs): fn's output does not require grad: no "
                             "input requires grad and fn uses no parameter that does, so the step "
                             "has no backward. Pass a tensor made with requires_grad=True, or use "
                             "a module's parameters in fn.")
        return out if out.dim() == 0 else out.sum()

    def prepare() -> None:
        for tensor in tensors:
            if tensor.is_leaf and tensor.requires_grad:
                tensor.grad = None

    params = {f"input{k}": t for k, t in enumerate(tensors)}
    device = tensors[0].device if tensors else torch.device("cpu")
    return Step(forward, prepare, params, None, device, False, tuple(tensors))


def trace_modules_of(model: torch.nn.Module | None):
    if model is None:
        return contextlib.nullcontext()
    return trace_modules(model)
