"""Observe one training step and tell it event by event: what ``BackwardStepper`` replays.

``StepReplay(make_step(model))`` runs the step and keeps its frames (one per event, with the
bytes alive and the state of every saved tensor), the saved tensors' descriptions and the
autograd graph they sit in; the widget (``ckptlib.widgets.stepper``) only shows them.

Design notes
============

What is observed. The step runs once under three observers, none of which allocates
or keeps a tensor:

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

The rerun's packs. The trace reports a rerun as one ``recompute`` event: the hook that
refills the dropped tensors runs under the checkpoint's own hooks, where nothing outside
sees it. But a rerun runs the forward's ops in the forward's order (that is how the
checkpoint matches tensors by index), so its pack #i comes as many ops before its last
pack as in forward. Its last pack is known: the ``early_stop`` event's index, else the
region's last tensor. Each rerun pack gets a frame there, after the op names on both
sides are compared; where they differ (a selective checkpoint skips ops in its rerun),
the packs are shown together at the end of the rerun, and say so.

Two passes. The picture needs the autograd graph as it stands after forward, and
walking it between forward and backward would put work (and meta tensors) inside the
metered step. So a forward-only pass (same inputs; the RNG state forked, so both passes
draw the same numbers) builds the graph once and learns which node holds which saved
tensor, in pack order. The metered pass then runs forward and backward back to back;
its packs come in the same order and get the same labels. A frame's picture is that
graph with each saved tensor's status replaced (``dataclasses.replace``), rendered once
per distinct set of states.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ckptlib.autograd_walk import walk as walk_nodes
from ckptlib.core.trace import TraceEvent, record_trace
from ckptlib.core.checkpoint import is_recomputing
from ckptlib.core.peek import peek_saved
from ckptlib.graph import AutogradGraph, autograd_graph, trace_modules
from ckptlib.memory import MemoryMeter, TimelineEntry, format_bytes
from ckptlib.storage import storage_ptr, storage_ptrs

__all__ = ["StepReplay", "Step", "make_step", "describe", "op_words", "STATES"]

STATES = ("saved", "dropped", "recomputed", "released")
_EVENT_PHASE = {"pack": "forward", "forward_done": "forward", "recompute": "recompute",
                "early_stop": "recompute", "unpack": "backward", "release": "backward"}


# ---------------------------------------------------------------------------
# Observing a pass: everything that happens, in order, as raw items
# ---------------------------------------------------------------------------


@dataclass
class _Item:
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


class _BeforeOp(TorchDispatchMode):
    """Calls back before every aten op (entered inside the meter, so it runs first)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        super().__init__()
        self.callback = callback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.callback()
        return func(*args, **(kwargs or {}))


class _Recorder:
    """The observers of one pass; appends an :class:`_Item` for everything it sees."""

    def __init__(self, inputs: tuple[torch.Tensor, ...] = ()) -> None:
        self.items: list[_Item] = []
        self.ops = 0
        self.meter: MemoryMeter | None = None
        self.live_before_op = 0
        # The step's inputs were made before it: the meter never counts their memory.
        self._input_storages = storage_ptrs(inputs)
        self.quiet = False          # while the graph is walked: its reads are not events
        self._detaching = False     # our own detach in pack is not an op of the step
        self._orders = 0
        self._order_of: dict[int, int] = {}       # id(stored tensor) -> pack number
        self._refs: dict[int, weakref.ref] = {}   # pack number -> weak reference to the stored tensor
        self._pending: list[_Item] = []

    def reading(self) -> int:
        live = self.meter.live_bytes if self.meter is not None else 0
        for item in self._pending:
            item.live = live
        self._pending.clear()
        return live

    def add(self, item: _Item) -> None:
        if not self.quiet:
            self.items.append(item)

    # -- the meter and the dispatch mode ---------------------------------------
    def on_op(self, entry: TimelineEntry) -> None:
        if self._detaching or self.quiet:
            return
        self.ops += 1
        self.add(_Item("op", self.ops, entry.live_bytes, op=entry.op, phase=entry.phase,
                       before=self.live_before_op))

    def before_op(self) -> None:
        self.live_before_op = self.reading()

    # -- the trace ------------------------------------------------------------------
    def on_event(self, event: TraceEvent) -> None:
        self.add(_Item("trace", self.ops, self.reading(), event=event, recomputing=is_recomputing()))

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
        self.add(_Item("pack", self.ops, self.reading(), order=order, meta=meta,
                       made_before=storage_ptr(tensor) in self._input_storages))
        return stored

    def unpack(self, stored: torch.Tensor) -> torch.Tensor:
        self.add(_Item("unpack", self.ops, self.reading(), order=self._order_of[id(stored)]))
        return stored

    def order_of(self, stored: Any) -> int | None:
        return self._order_of.get(id(stored))

    def _released(self, order: int, key: int) -> None:
        self._order_of.pop(key, None)
        self._refs.pop(order, None)
        item = _Item("release", self.ops, None, order=order)
        self.add(item)
        self._pending.append(item)


def _hooks(recorder: _Recorder):
    return torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)


# ---------------------------------------------------------------------------
# The graph pass: which node holds which saved tensor
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where a saved tensor sits in the graph: node id, attribute name (as ``autograd_graph`` names them)."""

    node_id: str
    name: str
    node_op: str
    module: str | None


@dataclass
class _GraphFacts:
    """What the graph pass reads from autograd's nodes besides the saved tensors."""

    sequence: dict[str, int]          # node id -> autograd's creation number (forward order)
    leaves: list[torch.Tensor]        # the leaves the step reaches: their .grad is reset before each pass


def _slots(loss: torch.Tensor, recorder: _Recorder, graph: AutogradGraph
           ) -> tuple[dict[int, Slot], dict[tuple[str, int], Slot], _GraphFacts]:
    """Outer pack number -> slot, and (raw region name, index) -> slot, read without recomputing;
    with each node's creation number, which tells when forward made it."""
    by_order: dict[int, Slot] = {}
    by_region: dict[tuple[str, int], Slot] = {}
    facts = _GraphFacts({}, [])
    for number, fn in enumerate(walk_nodes([loss.grad_fn])[0]):  # the walk that numbers n0, n1, ...
        node = graph[f"n{number}"]
        if node.op != fn.name().rsplit("::", 1)[-1]:  # pragma: no cover - autograd_graph changed its walk
            raise RuntimeError(f"BackwardStepper: node n{number} is {node.op} in autograd_graph but "
                               f"{fn.name()} in the stepper's walk; the two walks must agree.")
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


def _base_name(region: Any) -> str:
    """``Block.forward@3`` -> ``"Block.forward"``; ``f.<locals>.<lambda>@7`` -> ``"<lambda>"``."""
    return getattr(region, "name", str(region)).rpartition("<locals>.")[2]


# ---------------------------------------------------------------------------
# The widget
# ---------------------------------------------------------------------------


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


class StepReplay:
    """One step, observed: ``frames``, ``tensors`` (label -> description), ``peak_bytes``, and the
    ``graph`` after forward with ``slot_of_label`` (label -> where a node keeps that tensor)."""

    def __init__(self, step: Step, all_ops: bool = False) -> None:
        self.step = step
        self.tensors: dict[str, dict[str, Any]] = {}
        self.graph, self.slot_of_label = self._graph_pass()
        self.frames, self.peak_bytes = self._metered_pass(all_ops)

    def leaf_kind(self, slot: Slot) -> str | None:
        """Whose memory a saved tensor is, if a leaf's: ``"parameter"``, ``"buffer"`` or ``"leaf"``
        (memory that lives anyway), else ``None``."""
        return next((saved.leaf_kind or "leaf" for saved in self.graph[slot.node_id].saved
                     if saved.name == slot.name and saved.of_leaf), None)

    def _graph_pass(self) -> tuple[AutogradGraph, dict[str, Slot]]:
        step, recorder = self.step, _Recorder()
        devices = [step.device] if step.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            step.prepare()
            with record_trace(on_event=recorder.on_event), _hooks(recorder), _modules(step.model) as modules:
                loss = step.forward()
            recorder.quiet = True
            graph = autograd_graph(loss, params=step.params, modules=modules)
            by_order, by_region, facts = _slots(loss, recorder, graph)
            del loss
        self.sequence_of_node = facts.sequence
        self._leaves = facts.leaves
        # Pack order -> label. Outer packs not held by a node are checkpoint inputs: they are
        # saved as the checkpoint starts, so they belong to the next region that shows up.
        regions: list[str] = []
        self.outer_labels: dict[int, str] = {}
        waiting: list[int] = []
        plain = 0
        for item in recorder.items:
            if item.kind == "pack":
                if item.order in by_order:
                    self.outer_labels[item.order] = f"saved #{plain}"
                    plain += 1
                else:
                    waiting.append(item.order)
            elif item.kind == "trace" and item.event.region not in regions:
                regions.append(item.event.region)
                for count, order in enumerate(waiting):
                    suffix = "" if len(waiting) == 1 else f" #{count}"
                    self.outer_labels[order] = f"{{region {len(regions) - 1}}} input{suffix}"
                waiting = []
        for order in waiting:
            self.outer_labels[order] = f"kept #{order}"
        self.region_names = _display_names(regions, self.step.block_regions)
        # The graph's regions carry the checkpoint's global call number; draw the stable names.
        self.region_of_raw = dict(zip(regions, self.region_names))
        slot_of_label = {}
        for order, label in self.outer_labels.items():
            label = self.outer_labels[order] = label.format(
                **{f"region {k}": name for k, name in enumerate(self.region_names)})
            if order in by_order:
                slot_of_label[label] = by_order[order]
        for (region, index), slot in by_region.items():
            if region in regions:
                slot_of_label[f"{self.region_names[regions.index(region)]} #{index}"] = slot
        return graph, slot_of_label

    def _metered_pass(self, all_ops: bool) -> tuple[list[dict[str, Any]], int]:
        step = self.step
        recorder = _Recorder(step.inputs)
        step.prepare()
        for leaf in self._leaves:   # parameters a function closes over get fresh gradients too
            leaf.grad = None
        with MemoryMeter(step.device, backend="tensors", on_op=recorder.on_op) as meter:
            recorder.meter = meter
            with _BeforeOp(recorder.before_op), record_trace(on_event=recorder.on_event), _hooks(recorder):
                loss = step.forward()
                loss.backward()
                del loss
            recorder.reading()
        frames = _Frames(recorder.items, self)
        return (frames.all() if all_ops else frames.folded()), meter.peak_bytes



# ---------------------------------------------------------------------------
# From raw items to frames
# ---------------------------------------------------------------------------


def _display_names(regions: list[str], blocks: bool) -> list[str]:
    if blocks:
        return [f"block {k}" for k in range(len(regions))]
    bases = [_base_name(region) for region in regions]
    names = []
    for k, base in enumerate(bases):
        names.append(base if bases.count(base) == 1 else f"{base} {bases[:k].count(base)}")
    return names


_PHASE_RUNS = {"forward": "forward runs", "recompute": "the rerun runs", "backward": "backward runs"}
# What the aten ops of the demo models do, in words; other ops are named as they are.
_OP_WORDS = {
    "t": "t (transpose the weight: a view, no copy)", "addmm": "addmm (x @ W.T + b)",
    "mm": "mm (matrix multiply)", "relu": "relu", "threshold_backward": "threshold_backward (relu's gradient)",
    "mse_loss": "mse_loss (the loss)", "mse_loss_backward": "mse_loss_backward (the loss's gradient)",
    "sum": "sum", "ones_like": "ones_like (the loss's gradient, 1)", "add": "add", "mul": "mul",
    "detach": "detach (a view)", "view": "view (no copy)", "_unsafe_view": "view (no copy)",
}


def op_words(op: str) -> str:
    """An aten op's name with what it does, for the demo models' ops: ``"t"`` -> ``"t (transpose ...)"``."""
    return _OP_WORDS.get(op, op)


def describe(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> str:
    dims = "x".join(map(str, shape)) or "scalar"
    return f"{dims} {str(dtype).replace('torch.', '')}, {format_bytes(nbytes)}"


class _Frames:
    """Turns the metered pass's items into frames: states, words, and the rerun's packs placed."""

    def __init__(self, items: list[_Item], replay: StepReplay) -> None:
        self.items = items
        self.replay = replay
        self.labels = replay.outer_labels
        self.states: dict[str, str] = {}
        self.out: list[dict[str, Any]] = []
        self.names: dict[str, str] = {}          # raw region name -> display name
        self.first_packs: dict[str, dict[int, _Item]] = {}
        self.forward_done: dict[str, int] = {}
        self.op_names = [item.op for item in items if item.kind == "op"]
        self.last_recompute: _Item | None = None

    def region_name(self, item: _Item) -> str:
        region = item.event.region
        if region not in self.names:
            forward_regions = [r for r in self.names.values() if not r.endswith("(rerun's copy)")]
            if item.recomputing:
                self.names[region] = f"{_base_name(region)} (rerun's copy)"
            elif len(forward_regions) < len(self.replay.region_names):
                self.names[region] = self.replay.region_names[len(forward_regions)]
            else:  # pragma: no cover - the two passes differ
                raise RuntimeError("BackwardStepper: the metered pass ran a checkpoint the graph pass did not "
                                   "see; the step must run the same code every time (no branches on random "
                                   "numbers or on a counter).")
        return self.names[region]

    def all(self) -> list[dict[str, Any]]:
        queue: list[tuple[int, dict]] = []   # rerun packs to place: (ops stamp, frame)
        for position, item in enumerate(self.items):
            if item.kind == "trace" and item.event.kind == "recompute":
                queue = []
            ready = [entry for entry in queue if entry[0] < item.ops
                     or (item.kind == "trace" and self._ends_rerun(item, queue))]
            for entry in ready:
                queue.remove(entry)
                self._add(entry[1])
            self._item(item, position)
            if item.kind == "trace" and item.event.kind == "recompute":
                queue = self._rerun_packs(position)
        for _, frame in queue:
            self._add(frame)
        return self.out

    def folded(self) -> list[dict[str, Any]]:
        """The frames without the ops that changed no memory (views, ops whose output replaced a
        freed one): the live-bytes curve and its peak stay the same."""
        kept: list[dict[str, Any]] = []
        for frame in self.all():
            if not (frame["event"].endswith("_op") and kept and frame["live_bytes"] == kept[-1]["live_bytes"]):
                kept.append(frame)
        return kept

    def _ends_rerun(self, item: _Item, queue: list) -> bool:
        return bool(queue) and item.event.region == queue[0][1]["raw_region"] and \
            item.event.kind in ("early_stop", "unpack", "recompute")

    def _add(self, frame: dict[str, Any]) -> None:
        tensor, new_state = frame.pop("set", (None, None))
        frame.pop("raw_region", None)
        if tensor is not None:
            self.states[tensor] = new_state
        for label in frame.pop("release_region", ()):
            self.states[label] = "released"
        frame["states"] = dict(self.states)
        self.out.append(frame)

    def _frame(self, event: str, phase: str, text: str, live: int, **extra: Any) -> dict[str, Any]:
        return {"event": event, "phase": phase, "text": text, "live_bytes": live, "tensor": None,
                "region": None, "op": None, **extra}

    # -- one item --------------------------------------------------------------
    def _item(self, item: _Item, position: int) -> None:
        if item.kind == "op":
            # The live bytes change by what the op allocates, and by what died since the last
            # event: a tensor nothing refers to any more (not saved, not returned) dies between ops.
            own = item.live - item.before
            freed = (self.out[-1]["live_bytes"] if self.out else 0) - item.before
            change = f"+{format_bytes(own)} new" if own > 0 else "no new memory" if own == 0 else \
                f"-{format_bytes(-own)}"
            text = f"{_PHASE_RUNS[item.phase]} {op_words(item.op)}: {change}"
            if freed > 0:
                text += f"; before it ran, {format_bytes(freed)} freed: tensors nothing refers to any more"
            self._add(self._frame(f"{item.phase}_op", item.phase, text, item.live, op=item.op))
        elif item.kind == "trace":
            self._trace(item, self._next_trace(position))
        else:
            self._outer(item)

    def _outer(self, item: _Item) -> None:
        label = self.labels.get(item.order, f"kept #{item.order}")
        slot = self.replay.slot_of_label.get(label)
        # A checkpoint's input: what it keeps to rerun from (labelled "<region> input").
        region = label.rsplit(" input", 1)[0] if slot is None and " input" in label else None
        holder = f"{slot.node_op}.{slot.name}" if slot is not None else "the checkpoint"
        if item.kind == "pack":
            shape, dtype, nbytes = item.meta
            self.replay.tensors[label] = {"region": region, "shape": shape, "dtype": dtype, "nbytes": nbytes,
                                           **self._node_of(label)}
            if region is not None:
                text = f"{region} starts: keeps its input, {describe(*item.meta)}"
            else:
                where = f" (in {slot.module})" if slot is not None and slot.module else ""
                text = f"autograd saves {label} for {holder}{where}: {describe(*item.meta)}"
                owner = self.replay.leaf_kind(slot) if slot is not None else None
                if owner in ("parameter", "buffer"):
                    text += f", a {owner}'s own memory: nothing extra"
                elif owner == "leaf" or item.made_before:
                    text += ", an input of the step, made before it: nothing extra"
            self._add(self._frame("pack", "forward", text, item.live, tensor=label, region=region,
                                  set=(label, "saved")))
        elif item.kind == "unpack":
            text = f"{region} rerun: loads its kept input" if region is not None else f"{holder} unpacks {label}"
            self._add(self._frame("unpack", "backward" if region is None else "recompute", text, item.live,
                                  tensor=label, region=region))
        else:
            text = f"{label} released: {'its checkpoint is done' if slot is None else holder + ' has run'}"
            self._add(self._frame("release", "backward", text, item.live, tensor=label, region=region,
                                  set=(label, "released")))

    def _next_trace(self, position: int) -> _Item | None:
        return next((item for item in self.items[position + 1:] if item.kind == "trace"), None)

    def _trace(self, item: _Item, following: _Item | None) -> None:
        event = item.event
        region = self.region_name(item)
        label = f"{region} #{event.index}" if event.index is not None else None
        phase = "recompute" if item.recomputing else _EVENT_PHASE.get(event.kind, "backward")
        frame = self._frame(event.kind, phase, "", item.live, region=region, tensor=label)
        # A pack right before a checkpoint nobody has seen yet is that checkpoint keeping its input.
        starts = (following if following is not None and following.ops == item.ops
                  and following.event.region not in self.names else None)
        what = (f"the input of the nested checkpoint {_base_name(starts.event.region)}" if starts is not None
                else f"{event.op}")
        if event.kind == "pack" and item.recomputing:
            frame["text"] = (f"{region} forward: drops tensor #{event.index} ({what}), "
                             f"{describe(event.meta.shape, event.meta.dtype, event.meta.nbytes)}: "
                             "nothing keeps it, the original checkpoint reruns later")
            frame["tensor"] = None
        elif event.kind == "pack":
            self.first_packs.setdefault(event.region, {})[event.index] = item
            meta = event.meta
            self.replay.tensors[label] = {"region": region, "shape": meta.shape, "dtype": meta.dtype,
                                           "nbytes": meta.nbytes, **self._node_of(label)}
            frees = ""
            if "frees nothing" in event.detail:   # the trace: an input, a parameter or a view of one
                slot = self.replay.slot_of_label.get(label)
                owner = self.replay.leaf_kind(slot) if slot is not None else None
                whose = f"a {owner}'s own memory" if owner in ("parameter", "buffer") else "the checkpoint's input"
                frees = f", {whose}: dropping frees nothing"
            frame["text"] = (f"{region} forward: drops tensor #{event.index} ({what}), "
                             f"{describe(meta.shape, meta.dtype, meta.nbytes)}{frees}")
            frame["set"] = (label, "dropped")
        elif event.kind == "forward_done":
            self.forward_done.setdefault(event.region, item.ops)
            frame["text"] = f"{region} forward done: {event.detail}"
        elif event.kind == "recompute":
            self.last_recompute = item
            plain = f"rerunning {event.region} "
            why = event.detail[len(plain):] if event.detail.startswith(plain) else f"({event.detail})"
            frame["text"] = f"backward needs {region}'s tensor #{event.index}, which was dropped: {region} reruns {why}"
        elif event.kind == "early_stop":
            frame["text"] = f"{region} rerun: early stop at tensor #{event.index} ({event.detail})"
        elif event.kind == "unpack":
            loading = self.last_recompute
            if loading is not None and loading.ops == item.ops and loading.event.region != event.region:
                # The first thing a nested checkpoint's rerun does: load its input, an outer tensor.
                frame["text"] = (f"{self.names[loading.event.region]} rerun: loads its input, {label} "
                                 "(recomputed): handed over, released")
                frame["phase"] = "recompute"
            else:
                frame["text"] = f"{event.op or 'backward'} unpacks {label} (recomputed): handed over, released"
            frame["set"] = (label, "released")
        elif event.kind == "release":
            frame["text"] = f"{region}: {event.detail}, released"
            frame["release_region"] = [name for name, state in self.states.items()
                                       if state == "recomputed" and name.startswith(region + " #")]
        else:  # pragma: no cover - a trace kind this widget does not know yet
            frame["text"] = f"{region}: {event.kind} {event.detail}"
        self._add(frame)

    def _node_of(self, label: str) -> dict[str, Any]:
        slot = self.replay.slot_of_label.get(label)
        return {"node": slot and slot.node_op, "attribute": slot and slot.name}

    # -- the rerun's packs ----------------------------------------------------------
    def _rerun_packs(self, position: int) -> list[tuple[int, dict[str, Any]]]:
        """Frames for the packs of the rerun that starts at item ``position``, with their op stamps."""
        start = self.items[position]
        raw = start.event.region
        region = self.names[raw]
        packs = self.first_packs.get(raw, {})
        anchor = next((item for item in self.items[position + 1:] if item.kind == "trace"
                       and item.event.region == raw and item.event.kind in ("early_stop", "unpack", "recompute")),
                      None)
        if not packs or anchor is None:
            return []
        last = anchor.event.index if anchor.event.kind == "early_stop" else max(packs)
        stamps = self._align(start.ops, anchor, packs, last)
        placed = stamps is not None
        if stamps is None:
            stamps = {index: anchor.ops for index in packs if index <= last}
        queue = []
        for index in sorted(stamps):
            label = f"{region} #{index}"
            meta = packs[index].event.meta
            live = self._live_at(stamps[index], start)
            known = "" if placed else " (where in the rerun is not known: its ops differ from the forward's)"
            state = self.states.get(label)
            needed = state == "dropped"
            text = (f"{region} rerun: packs tensor #{index}, {describe(meta.shape, meta.dtype, meta.nbytes)}"
                    + ("" if needed else ", not needed any more") + known)
            frame = self._frame("pack", "recompute", text, live, region=region, tensor=label, raw_region=raw)
            if needed:
                frame["set"] = (label, "recomputed")
            queue.append((stamps[index], frame))
        return queue

    def _align(self, rerun_start: int, anchor: _Item, packs: dict[int, _Item], last: int) -> dict[int, int] | None:
        """Op stamps of the rerun's packs #0..last, or None when the rerun's ops do not match the forward's."""
        ends = [packs[last].ops]
        if anchor.event.kind != "early_stop" and anchor.event.region in self.forward_done:
            ends.append(self.forward_done[anchor.event.region])   # a rerun without early stop runs to the end
        first = packs[min(packs)].ops
        for end in ends:
            shift = anchor.ops - end
            if first + shift < rerun_start or shift <= 0:
                continue
            window = range(first, end)
            if all(self.op_names[stamp] == self.op_names[stamp + shift] for stamp in window):
                return {index: item.ops + shift for index, item in packs.items() if index <= last}
        return None

    def _live_at(self, stamp: int, start: _Item) -> int:
        """Bytes alive after op number ``stamp`` (or at the rerun's start, before any of its ops)."""
        if stamp <= start.ops:
            return start.live
        for item in self.items:
            if item.kind == "op" and item.ops == stamp:
                return item.live
        return start.live  # pragma: no cover - every stamp is an op's


# ---------------------------------------------------------------------------
# What to run
# ---------------------------------------------------------------------------


def make_step(model_or_fn: Any, inputs: tuple, batch: int) -> Step:
    if isinstance(model_or_fn, torch.nn.Module) and not inputs:
        model = model_or_fn
        missing = [name for name in ("loss", "example_batch", "checkpointing") if not hasattr(model, name)]
        if missing:
            raise TypeError(
                f"BackwardStepper(model): {type(model).__name__} has no {', '.join(missing)}; pass a ckptlib "
                "demo model (MLPChain, TinyTransformer), or a function and its inputs: "
                "BackwardStepper(fn, x) replays fn(x).sum().backward().")
        if model.checkpointing == "torch":
            raise ValueError(
                "BackwardStepper follows ckptlib.checkpoint's trace; checkpointing='torch' is "
                "torch.utils.checkpoint, which has no trace. Use 'block' (the same schedule with "
                "ckptlib.checkpoint), 'none', 'sqrt', 'selective' or a Plan.")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}.")
        data = model.example_batch(batch=batch)
        return Step(lambda: model.loss(data), lambda: model.zero_grad(set_to_none=True), None, model,
                     next(model.parameters()).device, getattr(model, "blocks", None) is not None
                     and model.checkpointing == "block", tuple(t for t in data if isinstance(t, torch.Tensor)))
    if not callable(model_or_fn):
        raise TypeError(f"BackwardStepper: expected a demo model or a function, got "
                        f"{type(model_or_fn).__name__}.")
    fn = model_or_fn
    # Inputs may be nested (a dict of tensors, a list of them) and need not require grad (token
    # ids): a step has a backward as soon as its output does, through an input or a parameter.
    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]

    def forward() -> torch.Tensor:
        out = fn(*inputs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"BackwardStepper: fn returned {type(out).__name__}; it must return a tensor "
                            "computed from the inputs (its .sum() is the loss).")
        if not out.requires_grad:
            raise ValueError("BackwardStepper(fn, *inputs): fn's output does not require grad: no input "
                             "requires grad and fn uses no parameter that does, so the step has no backward. "
                             "Pass a tensor made with requires_grad=True, or use a module's parameters in fn.")
        return out if out.dim() == 0 else out.sum()

    def prepare() -> None:
        for tensor in tensors:
            if tensor.is_leaf and tensor.requires_grad:
                tensor.grad = None

    params = {f"input{k}": t for k, t in enumerate(tensors)}
    device = tensors[0].device if tensors else torch.device("cpu")
    return Step(forward, prepare, params, None, device, False, tuple(tensors))


def _modules(model: torch.nn.Module | None):
    if model is None:
        return contextlib.nullcontext()
    return trace_modules(model)
