"""What the memory dashboard runs, and how one of its steps is measured and timed.

Two kinds of model. A *demo model* (``TinyTransformer``, ``MLPChain``, or a learner's model
with the same interface, :data:`MODEL_NEEDS`) has a ``checkpointing`` switch; the dashboard's
menu is the schedule registry's (``ckptlib.schedules.registry``), each label turned into the
switch's value for the model's depth. *Any other module* (a Hugging Face model) comes with its
inputs and is run by :class:`AppliedModel`: the same interface, its switch being the variants of
``ckptlib.apply_checkpointing`` on the model's repeated layers (:data:`APPLY_VARIANTS`).

What one step is. A *step* is one ``model.training_step(batch)`` (forward, loss,
backward) of a demo model or an :class:`AppliedModel`. It runs once under a
:class:`~ckptlib.memory.MemoryMeter` for the peak and the per-op timeline
(:func:`measure_step`, stopped at the first op above the memory limit), then bare for the
wall time (:func:`time_steps`: the CPU meter does Python work after every op, which would
inflate the time by a factor of two or so). On CUDA the meter reads the caching allocator,
elsewhere it counts live tensors.

Timing that noise cannot fake. A time measured now against one measured a minute ago
compares two moments of a shared machine, not two settings: that is how checkpointing, which
does more work, once read "0.24x the time". So with checkpointing on, each step times the
current setting *and* checkpointing off in the same click, in turns (see
:mod:`ckptlib.widgets._timing`), :data:`TIMED_STEPS` runs each after a warm-up, and the
readout gives both medians with their spreads. When the spreads overlap, or checkpointing
comes out faster, it says "within noise" instead of a bare ratio. The bare step is timed by
``dashboard.timer(model, batch) -> seconds``; a test replaces it with a clock it controls.

Phases. The meter colours the ops of a ckptlib checkpoint's rerun as "recompute";
``torch.utils.checkpoint`` has no public flag for its rerun, so the dashboard looks at
the saved-tensor hooks in force: while torch reruns a region its own recomputation hook
is on top (a torch internal; where a torch version moves it, the rerun stays in the
backward colour and the legend says why).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ckptlib.apply import Checkpointed, apply_checkpointing, repeated_layers
from ckptlib.memory import MemoryMeter, MemoryReport, TimelineEntry
from ckptlib.models import Checkpointing, MLPChain, TinyTransformer
from ckptlib.schedules import Plan
from ckptlib.schedules.registry import REGISTRY, by_mode, registered
from ckptlib.selective import save_matmuls
from ckptlib.widgets._timing import interleaved

MiB = 2**20
OFF = "none"
TIMED_STEPS = 3
# What a model passed to the dashboard must have, and why.
MODEL_NEEDS = {
    "blocks": "its repeated layers, in order (an nn.Sequential or nn.ModuleList): the schedules "
    "checkpoint them, and their number is the depth",
    "checkpointing": "a settable switch taking 'none', 'block', 'torch', 'sqrt', 'selective' or a "
    "ckptlib.schedules.Plan",
    "example_batch": "example_batch(batch=n): a batch of n examples on the model's device",
    "training_step": "training_step(batch): forward, loss and backward on that batch",
}
# ckptlib.apply_checkpointing's variants, as a model of any kind offers them (None: not applied).
APPLY_VARIANTS: dict[str, dict[str, Any] | None] = {
    OFF: None,
    "every layer": {},
    "every 2nd layer": {"every_n": 2},
    "selective (save matmuls)": {"how": save_matmuls},
    "offload": {"how": "offload"},
}
TORCH = REGISTRY["torch"].label  # torch.utils.checkpoint's rerun is told apart by its hooks


def in_mib(nbytes: float, digits: int = 2) -> str:
    """``nbytes`` in MiB, whatever its size: every number of the dashboard in the plot's unit."""
    return f"{nbytes / MiB:.{digits}f} MiB"


class OverLimit(MemoryError):
    """Raised from the meter's per-op callback: the step crossed ``memory_limit_bytes``."""

    def __init__(self, entry: TimelineEntry) -> None:
        super().__init__(
            f"{in_mib(entry.live_bytes)} live after op #{entry.index} ({entry.op}, {entry.phase})"
        )
        self.entry = entry
        self.timeline: list[TimelineEntry] = []


class RanAsPlain(Exception):
    """A checkpointing schedule's step recomputed nothing: the model does not implement it."""


def demo_schedules() -> dict[str, Callable[[int], Checkpointing]]:
    """Menu label -> the demo model's ``checkpointing`` value for ``depth`` blocks (the
    registry's)."""
    return {schedule.label: schedule.dashboard_value for schedule in registered("dashboard")}


def applied_schedules() -> dict[str, Callable[[int], Checkpointing]]:
    """Menu label -> the :class:`AppliedModel` switch's value (the label itself)."""
    return {label: (lambda depth, label=label: label) for label in APPLY_VARIANTS}


def recomputes(value: Checkpointing, depth: int) -> bool:
    """Does a ckptlib demo model, run with ``value``, recompute anything in backward?

    A plan for a single block keeps everything (nothing to recompute), so "nothing was
    recomputed" only tells that a model ignored the value when the demo models would not.
    """
    if isinstance(value, Plan):
        return value.forward_steps > 0
    schedule = by_mode(value)
    if schedule is None or schedule.plan is None:
        return value != OFF
    return schedule.make(depth).forward_steps > 0


def knows_its_schedules(model: Any) -> bool:
    """A model whose switch runs every schedule of its menu (nothing to find out by running)."""
    return isinstance(model, (TinyTransformer, MLPChain, AppliedModel))


TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def torch_recomputing() -> bool | None:
    """Is ``torch.utils.checkpoint`` rerunning a region now? ``None``: this torch does not say."""
    if TOP_HOOKS is None:
        return None
    top = TOP_HOOKS(False)
    pack = top[0] if top else None
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" and getattr(
        pack, "__qualname__", ""
    ).startswith("_recomputation_hook")


def check_model(model: Any) -> None:
    """Raise a ``TypeError`` naming what ``model`` lacks to be run by the dashboard (see
    :data:`MODEL_NEEDS`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"MemoryDashboard(model=...) needs an nn.Module, got {type(model).__name__}."
        )
    missing = [name for name in MODEL_NEEDS if not hasattr(model, name)]
    if not missing and not hasattr(model.blocks, "__len__"):
        missing = ["blocks"]
    if missing:
        needs = "; ".join(f"{name}: {MODEL_NEEDS[name]}" for name in missing)
        raise TypeError(
            f"MemoryDashboard(model=...): {type(model).__name__} has no {', '.join(missing)}. "
            f"The dashboard needs {needs}. ckptlib's demo models (TinyTransformer, MLPChain) have "
            "all of these; give your model the same, or pass its inputs as batch= (a dict, "
            "tensors, or a callable n -> inputs) to run it through ckptlib.apply_checkpointing, "
            "or run it with ckptlib.measure instead."
        )
    has_parameters(model)


def has_parameters(model: nn.Module) -> None:
    if next(model.parameters(), None) is None:
        raise TypeError(
            f"MemoryDashboard(model=...): {type(model).__name__} has no parameters, so "
            "there is no device to run on and no gradient to compute."
        )


def time_one_step(model: Any, batch: Any) -> float:
    """Seconds of one bare ``model.training_step(batch)`` (on CUDA, until the device is done)."""
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.training_step(batch)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_step(
    model: Any,
    batch: Any,
    value: Checkpointing,
    device: torch.device,
    limit: float,
    watch_torch: bool,
) -> tuple[MemoryReport, list[TimelineEntry], float]:
    """One ``training_step`` with ``checkpointing = value`` under the meter: its report, its
    timeline (torch's rerun coloured as recompute when ``watch_torch``) and its loss. A step
    whose live memory crosses ``limit`` raises :class:`OverLimit` carrying the partial timeline."""
    timeline: list[TimelineEntry] = []

    def on_op(entry: TimelineEntry) -> None:
        if watch_torch and entry.phase == "backward" and torch_recomputing():
            entry = entry._replace(phase="recompute")
        timeline.append(entry)
        if entry.live_bytes > limit:
            raise OverLimit(entry)

    model.checkpointing = value
    try:
        with MemoryMeter(device, on_op=on_op) as meter:
            loss = model.training_step(batch)
    except OverLimit as error:
        error.timeline = timeline
        raise
    return meter.report(), timeline, loss


def time_steps(
    model: Any,
    batch: Any,
    value: Checkpointing,
    timer: Callable[[Any, Any], float],
    time_off: bool,
    warm: bool,
) -> dict[str, list[float]]:
    """:data:`TIMED_STEPS` bare steps of ``value`` (key ``"current"``) and, with ``time_off``, as
    many of checkpointing off (key :data:`OFF`), in turns; after a warm-up of each unless
    ``warm``. The model's switch is left at ``value``."""

    def run_with(checkpointing: Checkpointing) -> Callable[[], float]:
        def timed() -> float:
            model.checkpointing = checkpointing
            return timer(model, batch)

        return timed

    runs = {"current": run_with(value)}
    if time_off:
        runs[OFF] = run_with(OFF)
    try:
        return interleaved(runs, TIMED_STEPS, warm_up=not warm)
    finally:
        model.checkpointing = value


class AppliedModel:
    """A module of any kind (a Hugging Face model) and its inputs, with a demo model's interface.

    ``checkpointing`` is one of :data:`APPLY_VARIANTS`: setting it undoes the variant before
    and applies the new one with ``ckptlib.apply_checkpointing`` on the model's repeated layers
    (``blocks``; ``"none"`` leaves the model as it came, its own ``forward`` everywhere).
    ``example_batch(batch=n)`` gives the inputs (``inputs(n)`` for a callable), on the model's
    device; ``training_step`` calls the model with them (a dict as keywords, a tuple as
    positional arguments, a tensor alone; ``use_cache=False`` where its ``forward`` takes it,
    unless the inputs say otherwise) and differentiates the output's ``loss`` (a Hugging
    Face model given ``labels``), else the mean of its first floating-point tensor.
    """

    def __init__(self, model: nn.Module, inputs: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"MemoryDashboard(model=...) needs an nn.Module, got {type(model).__name__}."
            )
        has_parameters(model)
        self.model = model
        self.blocks = [module for _, module in repeated_layers(model)]
        if not self.blocks:
            raise TypeError(
                f"MemoryDashboard(model=...): {type(model).__name__} has no ModuleList or "
                "Sequential of repeated layers for ckptlib.apply_checkpointing to "
                "checkpoint; give it one, or run the model with ckptlib.measure instead."
            )
        if callable(inputs):
            try:
                inspect.signature(inputs).bind(1)
            except (TypeError, ValueError):
                raise TypeError(
                    "MemoryDashboard: a callable batch= is called with the batch size n "
                    "and returns the model's inputs for n examples; "
                    f"{getattr(inputs, '__name__', inputs)!r} does not take one argument."
                ) from None
        elif not isinstance(inputs, (torch.Tensor, tuple, list, Mapping)):
            raise TypeError(
                "MemoryDashboard(model=...): batch= must be the model's inputs (a dict "
                "of keyword arguments, a tensor or a tuple of them) or a callable n -> "
                f"inputs, got {type(inputs).__name__}."
            )
        self.inputs = inputs
        # A training step needs no cache (apply_checkpointing would drop it, and warn).
        self.keywords = (
            {"use_cache": False}
            if "use_cache" in inspect.signature(model.forward).parameters
            else {}
        )
        self.handle: Checkpointed | None = None
        self._checkpointing = OFF

    @property
    def fixed_batch_size(self) -> int | None:
        """The inputs' batch size (their first tensor's first dimension); ``None`` for a
        callable."""
        if callable(self.inputs):
            return None
        first = next(iter(_tensors_in(self.inputs)), None)
        return first.shape[0] if first is not None and first.dim() else 1

    def parameters(self):
        return self.model.parameters()

    @property
    def checkpointing(self) -> str:
        return self._checkpointing

    @checkpointing.setter
    def checkpointing(self, value: str) -> None:
        if value not in APPLY_VARIANTS:
            raise ValueError(
                f"checkpointing={value!r} is not one of {', '.join(map(repr, APPLY_VARIANTS))}."
            )
        if value == self._checkpointing:
            return
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self._checkpointing = OFF
        if APPLY_VARIANTS[value] is not None:
            self.handle = apply_checkpointing(self.model, **APPLY_VARIANTS[value])
        self._checkpointing = value

    def example_batch(self, batch: int) -> Any:
        inputs = self.inputs(batch) if callable(self.inputs) else self.inputs
        if isinstance(inputs, Mapping):
            inputs = dict(inputs)  # a tokenizer's BatchEncoding, as the dict of keywords it is
        device = next(self.model.parameters()).device
        return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)

    def training_step(self, inputs: Any) -> float:
        self.model.zero_grad(set_to_none=True)
        if isinstance(inputs, Mapping):
            output = self.model(**{**self.keywords, **inputs})
        elif isinstance(inputs, (tuple, list)):
            output = self.model(*inputs, **self.keywords)
        else:
            output = self.model(inputs, **self.keywords)
        loss = _loss_of(output, type(self.model).__name__)
        loss.backward()
        return loss.item()


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _loss_of(output: Any, name: str) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in _tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise RuntimeError(
            f"{name}'s output has no loss and no tensor that needs a gradient; give it "
            "labels (a Hugging Face model then returns its loss) or inputs it trains on."
        )
    return tensors[0].float().mean()
