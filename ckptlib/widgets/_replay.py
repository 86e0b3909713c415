"""One training step, observed and told event by event: what ``BackwardStepper`` replays.

``StepReplay(make_step(model, (), batch))`` runs the step (``ckptlib.widgets._step``: what
runs, and what watches it) and keeps its frames (one :class:`AnimationFrame` per event, with the
bytes alive and the state of every saved tensor), the saved tensors' descriptions and the
autograd graph they sit in; the widget (``ckptlib.widgets.stepper``) only shows them.

Design notes
============

Typed events. Each trace event has a method of its own (``on_pack``, ``on_recompute``...)
that reads the event's fields (``index``, ``meta``, ``frees_memory``, ``needed`` of
``total``, ``region.name``); the trace's prose (``event.detail``) is quoted where a frame
repeats it, never read back.

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

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator

import torch

from ckptlib.core.errors import RegionId, TensorMeta, shape_text
from ckptlib.core.trace import record_trace
from ckptlib.graph import AutogradGraph, autograd_graph
from ckptlib.graph.dot import memory_key
from ckptlib.memory import MemoryMeter, format_bytes
from ckptlib.widgets._step import (
    BeforeOp, Item, Recorder, Slot, Step, find_slots, recorder_hooks, trace_modules_of,
)

__all__ = ["StepReplay", "AnimationFrame", "FRAME_KEYS", "describe", "op_words", "STATES"]

STATES = ("saved", "dropped", "recomputed", "released")
_EVENT_PHASE = {"pack": "forward", "forward_done": "forward", "recompute": "recompute",
                "early_stop": "recompute", "unpack": "backward", "release": "backward"}
_RERUN_ANCHORS = ("early_stop", "unpack", "recompute")   # events that end a rerun's packs


def _base_name(region: RegionId) -> str:
    """What a region runs, without its scope: ``Block.forward``; ``f.<locals>.<lambda>`` ->
    ``<lambda>``."""
    return region.name.rpartition("<locals>.")[2]


# ---------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class AnimationFrame(Mapping):
    """One event of the step as the stepper tells it; read ``frame.text`` or ``frame["text"]``.

    ``states`` is label -> state of every saved tensor packed so far, right after the event.
    """

    event: str                 # "forward_op", "recompute_op", "backward_op" or a trace kind
    phase: str                 # "forward", "recompute", "backward"
    text: str
    live_bytes: int
    tensor: str | None = None  # the label of the saved tensor the event is about
    region: str | None = None  # the checkpoint's name
    op: str | None = None      # an op's name
    states: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key not in FRAME_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(FRAME_KEYS)

    def __len__(self) -> int:
        return len(FRAME_KEYS)


FRAME_KEYS = tuple(f.name for f in fields(AnimationFrame))


class StepReplay:
    """One step, observed: ``frames``, ``tensors`` (label -> description), ``peak_bytes``, and the
    ``graph`` after forward with ``slot_of_label`` (label -> where a node keeps that tensor) and
    ``sharers`` (label -> every label that is the same memory, itself included, in pack order)."""

    def __init__(self, step: Step, all_ops: bool = False) -> None:
        self.step = step
        self.tensors: dict[str, dict[str, Any]] = {}
        self.graph, self.slot_of_label = self._graph_pass()
        self.frames, self.peak_bytes = self._metered_pass(all_ops)

    def leaf_kind(self, slot: Slot | None) -> str | None:
        """Whose memory a saved tensor is, if a leaf's: ``"parameter"``, ``"buffer"`` or ``"leaf"``
        (memory that lives anyway), else ``None``."""
        if slot is None:
            return None
        return next((saved.leaf_kind or "leaf" for saved in self.graph[slot.node_id].saved
                     if saved.name == slot.name and saved.of_leaf), None)

    def _graph_pass(self) -> tuple[AutogradGraph, dict[str, Slot]]:
        step, recorder = self.step, Recorder()
        devices = [step.device] if step.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            step.prepare()
            with record_trace(on_event=recorder.on_event), recorder_hooks(recorder), \
                    trace_modules_of(step.model) as modules:
                loss = step.forward()
            recorder.quiet = True
            graph = autograd_graph(loss, params=step.params, modules=modules)
            by_order, by_region, facts = find_slots(loss, recorder, graph)
            del loss
        self.sequence_of_node = facts.sequence
        self._leaves = facts.leaves
        # Pack order -> label. Outer packs not held by a node are checkpoint inputs: they are
        # saved as the checkpoint starts, so they belong to the next region that shows up.
        regions: list[RegionId] = []
        self.outer_labels: dict[int, str] = {}
        inputs_of: list[list[int]] = []   # per region, in order: the outer packs it keeps as input
        waiting: list[int] = []
        for item in recorder.items:
            if item.kind == "pack" and item.order in by_order:
                self.outer_labels[item.order] = f"saved #{len(self.outer_labels)}"
            elif item.kind == "pack":
                waiting.append(item.order)
            elif item.kind == "trace" and item.event.region not in regions:
                regions.append(item.event.region)
                inputs_of.append(waiting)
                waiting = []
        self.region_names = _display_names(regions, self.step.block_regions)
        # The graph's regions carry the checkpoint's global call number; draw the stable names.
        self.region_of_raw = dict(zip(regions, self.region_names))
        slot_of_label = {label: by_order[order] for order, label in self.outer_labels.items()}
        self.input_region: dict[str, str] = {}   # "<region> input" label -> its region
        for name, orders in zip(self.region_names, inputs_of):
            for count, order in enumerate(orders):
                label = f"{name} input" + ("" if len(orders) == 1 else f" #{count}")
                self.outer_labels[order], self.input_region[label] = label, name
        for order in waiting:
            self.outer_labels[order] = f"kept #{order}"
        for (region, index), slot in by_region.items():
            if region in self.region_of_raw:
                slot_of_label[f"{self.region_of_raw[region]} #{index}"] = slot
        # Labels that are one memory (a ReLU's output is the next Linear's input) are one box
        # in the picture; the words name the first of them where a later one is packed.
        by_memory: dict[tuple, list[str]] = {}
        for label, slot in slot_of_label.items():
            node = graph[slot.node_id]
            saved = next(s for s in node.saved if s.name == slot.name)
            by_memory.setdefault(memory_key(node, saved), []).append(label)
        self.sharers = {label: tuple(group) for group in by_memory.values() for label in group}
        return graph, slot_of_label

    def _metered_pass(self, all_ops: bool) -> tuple[list[AnimationFrame], int]:
        step = self.step
        recorder = Recorder(step.inputs)
        step.prepare()
        for leaf in self._leaves:   # parameters a function closes over get fresh gradients too
            leaf.grad = None
        with MemoryMeter(step.device, backend="tensors", on_op=recorder.on_op) as meter:
            recorder.meter = meter
            with BeforeOp(recorder.before_op), record_trace(on_event=recorder.on_event), \
                    recorder_hooks(recorder):
                loss = step.forward()
                loss.backward()
                del loss
            recorder.reading()
        frames = _AnimationFrames(recorder.items, self)
        return (frames.all() if all_ops else frames.folded()), meter.peak_bytes


# ---------------------------------------------------------------------------
# From raw items to frames
# ---------------------------------------------------------------------------


def _display_names(regions: list[RegionId], blocks: bool) -> list[str]:
    if blocks:
        return [f"block {k}" for k in range(len(regions))]
    bases = [_base_name(region) for region in regions]
    return [base if bases.count(base) == 1 else f"{base} {bases[:k].count(base)}"
            for k, base in enumerate(bases)]


_PHASE_RUNS = {"forward": "forward runs", "recompute": "the rerun runs",
               "backward": "backward runs"}
# What the aten ops of the demo models do, in words; other ops are named as they are.
_OP_WORDS = {
    "t": "t (transpose the weight: a view, no copy)", "addmm": "addmm (x @ W.T + b)",
    "mm": "mm (matrix multiply)", "relu": "relu",
    "threshold_backward": "threshold_backward (relu's gradient)", "mse_loss": "mse_loss (the loss)",
    "mse_loss_backward": "mse_loss_backward (the loss's gradient)",
    "sum": "sum", "ones_like": "ones_like (the loss's gradient, 1)", "add": "add", "mul": "mul",
    "detach": "detach (a view)", "view": "view (no copy)", "_unsafe_view": "view (no copy)",
}


def op_words(op: str) -> str:
    """An aten op's name with what it does, for the demo models' ops: ``"t"`` ->
    ``"t (transpose ...)"``."""
    return _OP_WORDS.get(op, op)


def describe(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> str:
    return f"{shape_text(shape, dtype)}, {format_bytes(nbytes)}"


def _describe(meta: TensorMeta) -> str:
    return describe(meta.shape, meta.dtype, meta.nbytes)


class _AnimationFrames:
    """Turns the metered pass's items into frames: states, words, and the rerun's packs placed.

    One method per item: ``on_op``, the outer hook's ``on_outer``, and one per trace kind
    (``on_pack``, ``on_forward_done``, ``on_recompute``, ``on_early_stop``, ``on_unpack``,
    ``on_release``), each handed the event's frame with its phase, region and tensor filled in.
    """

    def __init__(self, items: list[Item], replay: StepReplay) -> None:
        self.items = items
        self.replay = replay
        self.labels = replay.outer_labels
        self.states: dict[str, str] = {}
        self.out: list[AnimationFrame] = []
        self.names: dict[RegionId, str] = {}          # region -> display name
        self.first_packs: dict[RegionId, dict[int, Item]] = {}
        self.forward_done: dict[RegionId, int] = {}
        self.op_names = [item.op for item in items if item.kind == "op"]
        self.last_recompute: Item | None = None
        self.rerun: RegionId | None = None             # the region whose rerun's packs are queued

    def region_name(self, item: Item) -> str:
        region = item.event.region
        if region not in self.names:
            forward_regions = [r for r in self.names.values() if not r.endswith("(rerun's copy)")]
            if item.recomputing:
                self.names[region] = f"{_base_name(region)} (rerun's copy)"
            elif len(forward_regions) < len(self.replay.region_names):
                self.names[region] = self.replay.region_names[len(forward_regions)]
            else:  # pragma: no cover - the two passes differ
                raise RuntimeError("BackwardStepper: the metered pass ran a checkpoint the graph "
                                   "pass did not see; the step must run the same code every time "
                                   "(no branches on random numbers or on a counter).")
        return self.names[region]

    def all(self) -> list[AnimationFrame]:
        # rerun packs: (op stamp, frame, state)
        queue: list[tuple[int, AnimationFrame, str | None]] = []
        for position, item in enumerate(self.items):
            starts_rerun = item.kind == "trace" and item.event.kind == "recompute"
            if starts_rerun:
                queue = []
            ends_rerun = item.kind == "trace" and item.event.region == self.rerun \
                and item.event.kind in _RERUN_ANCHORS
            for entry in [entry for entry in queue if entry[0] < item.ops or ends_rerun]:
                queue.remove(entry)
                self._add(entry[1], entry[2])
            if item.kind == "op":
                self.on_op(item)
            elif item.kind == "trace":
                self._on_event(item, position)
            else:
                self.on_outer(item)
            if starts_rerun:
                queue = self._rerun_packs(position)
        for _, frame, state in queue:
            self._add(frame, state)
        return self.out

    def folded(self) -> list[AnimationFrame]:
        """The frames without the ops that changed no memory (views, ops whose output replaced a
        freed one): the live-bytes curve and its peak stay the same."""
        kept: list[AnimationFrame] = []
        for frame in self.all():
            same = kept and frame.live_bytes == kept[-1].live_bytes
            if not (frame.event.endswith("_op") and same):
                kept.append(frame)
        return kept

    def _add(self, frame: AnimationFrame, state: str | None = None,
             released: tuple[str, ...] = ()) -> None:
        """Append ``frame``: its tensor takes ``state`` (if given), every label in ``released`` is
        released, and the frame keeps every tensor's state after that."""
        if state is not None:
            self.states[frame.tensor] = state
        for label in released:
            self.states[label] = "released"
        self.out.append(replace(frame, states=dict(self.states)))

    # -- ops and the outer hook ------------------------------------------------
    def on_op(self, item: Item) -> None:
        # The live bytes change by what the op allocates, and by what died since the last
        # event: a tensor nothing refers to any more (not saved, not returned) dies between ops.
        own = item.live - item.before
        freed = (self.out[-1].live_bytes if self.out else 0) - item.before
        change = f"+{format_bytes(own)} new" if own > 0 else "no new memory" if own == 0 else \
            f"-{format_bytes(-own)}"
        text = f"{_PHASE_RUNS[item.phase]} {op_words(item.op)}: {change}"
        if freed > 0:
            text += (f"; before it ran, {format_bytes(freed)} freed: tensors nothing refers to "
                     "any more")
        self._add(AnimationFrame(f"{item.phase}_op", item.phase, text, item.live, op=item.op))

    def on_outer(self, item: Item) -> None:
        label = self.labels.get(item.order, f"kept #{item.order}")
        slot = self.replay.slot_of_label.get(label)
        # A checkpoint's input (what it keeps to rerun from) has its region.
        region = self.replay.input_region.get(label)
        holder = f"{slot.node_op}.{slot.name}" if slot is not None else "the checkpoint"
        if item.kind == "pack":
            shape, dtype, nbytes = item.meta
            self.replay.tensors[label] = {"region": region, "shape": shape, "dtype": dtype,
                                           "nbytes": nbytes, **self._node_of(label)}
            if region is not None:
                text = f"{region} starts: keeps its input, {describe(*item.meta)}"
            else:
                where = f" (in {slot.module})" if slot is not None and slot.module else ""
                text = f"autograd saves {label} for {holder}{where}: {describe(*item.meta)}"
                owner = self.replay.leaf_kind(slot)
                if owner in ("parameter", "buffer"):
                    text += f", a {owner}'s own memory: nothing extra"
                elif owner == "leaf" or item.made_before:
                    text += ", an input of the step, made before it: nothing extra"
                elif self.replay.sharers[label][0] != label:
                    text += (f", the same memory as {self.replay.sharers[label][0]}: one box in "
                             "the graph")
            self._add(AnimationFrame("pack", "forward", text, item.live, label, region), "saved")
        elif item.kind == "unpack":
            text = (f"{region} rerun: loads its kept input" if region is not None
                    else f"{holder} unpacks {label}")
            phase = "backward" if region is None else "recompute"
            self._add(AnimationFrame("unpack", phase, text, item.live, label, region))
        else:
            why = "its checkpoint is done" if slot is None else f"{holder} has run"
            text = f"{label} released: {why}"
            self._add(AnimationFrame("release", "backward", text, item.live, label, region),
                      "released")

    def _node_of(self, label: str) -> dict[str, Any]:
        slot = self.replay.slot_of_label.get(label)
        return {"node": slot and slot.node_op, "attribute": slot and slot.name}

    # -- the trace's events: one method per kind ------------------------------------
    def _on_event(self, item: Item, position: int) -> None:
        event = item.event
        region = self.region_name(item)
        label = f"{region} #{event.index}" if event.index is not None else None
        phase = "recompute" if item.recomputing else _EVENT_PHASE[event.kind]
        frame = AnimationFrame(event.kind, phase, "", item.live, tensor=label, region=region)
        getattr(self, f"on_{event.kind}")(item, frame, position)

    def on_pack(self, item: Item, frame: AnimationFrame, position: int) -> None:
        event = item.event
        # A pack right before a checkpoint nobody has seen yet is that checkpoint keeping its input.
        following = next((later for later in self.items[position + 1:] if later.kind == "trace"),
                         None)
        starts = following is not None and following.ops == item.ops \
            and following.event.region not in self.names
        what = (f"the input of the nested checkpoint {_base_name(following.event.region)}"
                if starts else event.op)
        text = (f"{frame.region} forward: drops tensor #{event.index} ({what}), "
                f"{_describe(event.meta)}")
        if item.recomputing:
            text += ": nothing keeps it, the original checkpoint reruns later"
            self._add(replace(frame, tensor=None, text=text))
            return
        self.first_packs.setdefault(event.region, {})[event.index] = item
        meta = event.meta
        self.replay.tensors[frame.tensor] = {"region": frame.region, "shape": meta.shape,
                                             "dtype": meta.dtype, "nbytes": meta.nbytes,
                                             **self._node_of(frame.tensor)}
        if not event.frees_memory:   # an input, a parameter or a view of one
            owner = self.replay.leaf_kind(self.replay.slot_of_label.get(frame.tensor))
            whose = (f"a {owner}'s own memory" if owner in ("parameter", "buffer")
                     else "the checkpoint's input")
            text += f", {whose}: dropping frees nothing"
        self._add(replace(frame, text=text), "dropped")

    def on_forward_done(self, item: Item, frame: AnimationFrame, position: int) -> None:
        self.forward_done.setdefault(item.event.region, item.ops)
        self._add(replace(frame, text=f"{frame.region} forward done: {item.event.detail}"))

    def on_recompute(self, item: Item, frame: AnimationFrame, position: int) -> None:
        event, region = item.event, frame.region
        self.last_recompute = item
        why = f"for {event.needed} of {event.total} saved tensors"
        self._add(replace(frame, text=f"backward needs {region}'s tensor #{event.index}, which "
                                      f"was dropped: {region} reruns {why}"))

    def on_early_stop(self, item: Item, frame: AnimationFrame, position: int) -> None:
        event = item.event
        text = f"{frame.region} rerun: early stop at tensor #{event.index} ({event.detail})"
        self._add(replace(frame, text=text))

    def on_unpack(self, item: Item, frame: AnimationFrame, position: int) -> None:
        event, loading = item.event, self.last_recompute
        if loading is not None and loading.ops == item.ops and loading.event.region != event.region:
            # The first thing a nested checkpoint's rerun does: load its input, an outer tensor.
            text = (f"{self.names[loading.event.region]} rerun: loads its input, {frame.tensor} "
                    "(recomputed): handed over, released")
            frame = replace(frame, phase="recompute", text=text)
        else:
            text = (f"{event.op or 'backward'} unpacks {frame.tensor} (recomputed): handed over, "
                    "released")
            frame = replace(frame, text=text)
        self._add(frame, "released")

    def on_release(self, item: Item, frame: AnimationFrame, position: int) -> None:
        unused = tuple(label for label, state in self.states.items() if state == "recomputed"
                       and self.replay.tensors[label]["region"] == frame.region)
        text = f"{frame.region}: {item.event.detail}, released"
        self._add(replace(frame, text=text), released=unused)

    # -- the rerun's packs ----------------------------------------------------------
    def _rerun_packs(self, position: int) -> list[tuple[int, AnimationFrame, str | None]]:
        """Frames for the packs of the rerun that starts at item ``position``, with their op stamps
        and the state each gives its tensor."""
        start = self.items[position]
        region = self.rerun = start.event.region
        name = self.names[region]
        packs = self.first_packs.get(region, {})
        anchor = next((item for item in self.items[position + 1:] if item.kind == "trace"
                       and item.event.region == region and item.event.kind in _RERUN_ANCHORS), None)
        if not packs or anchor is None:
            return []
        last = anchor.event.index if anchor.event.kind == "early_stop" else max(packs)
        stamps = self._align(start.ops, anchor, packs, last)
        known = "" if stamps is not None else \
            " (where in the rerun is not known: its ops differ from the forward's)"
        if stamps is None:
            stamps = {index: anchor.ops for index in packs if index <= last}
        queue = []
        for index in sorted(stamps):
            label = f"{name} #{index}"
            needed = self.states.get(label) == "dropped"
            text = (f"{name} rerun: packs tensor #{index}, {_describe(packs[index].event.meta)}"
                    + ("" if needed else ", not needed any more") + known)
            live = self._live_at(stamps[index], start)
            frame = AnimationFrame("pack", "recompute", text, live, label, name)
            queue.append((stamps[index], frame, "recomputed" if needed else None))
        return queue

    def _align(self, rerun_start: int, anchor: Item, packs: dict[int, Item], last: int
               ) -> dict[int, int] | None:
        """Op stamps of the rerun's packs #0..last, or None when the rerun's ops do not match the
        forward's: the same ops shifted, else the same ops with a ``detach`` here and there in the
        rerun (the checkpoint detaches a saved parameter it hands back)."""
        ends = [packs[last].ops]
        if anchor.event.kind != "early_stop" and anchor.event.region in self.forward_done:
            # A rerun without early stop runs to the end.
            ends.append(self.forward_done[anchor.event.region])
        first = packs[min(packs)].ops
        for detaches in (False, True):
            for end in ends:
                rerun_of = self._match(first, end, rerun_start, anchor.ops, detaches)
                if rerun_of is not None:
                    return {index: rerun_of[item.ops] for index, item in packs.items()
                            if index <= last}
        return None

    def _match(self, first: int, end: int, rerun_start: int, rerun_end: int, detaches: bool
               ) -> dict[int, int] | None:
        """Forward stamp -> rerun stamp for the forward's ops ``first..end`` and the rerun's that
        end at ``rerun_end``, matched from the end back (skipping the rerun's extra ``detach``
        ops if ``detaches``); None where they differ or the rerun would start too early."""
        names, rerun = self.op_names, rerun_end
        rerun_of = {end: rerun_end}
        for stamp in range(end - 1, first - 1, -1):
            rerun -= 1
            while detaches and rerun > rerun_start and names[rerun] == "detach" != names[stamp]:
                rerun -= 1
            if rerun < rerun_start or names[rerun] != names[stamp]:
                return None
            rerun_of[stamp] = rerun
        return rerun_of if end < rerun_end and rerun_of[first] >= rerun_start else None

    def _live_at(self, stamp: int, start: Item) -> int:
        """Bytes alive after op number ``stamp`` (or at the rerun's start, before its ops)."""
        if stamp <= start.ops:
            return start.live
        for item in self.items:
            if item.kind == "op" and item.ops == stamp:
                return item.live
        return start.live  # pragma: no cover - every stamp is an op's
