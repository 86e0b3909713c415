"""Run a chain of modules under a checkpointing plan: nested ``ckptlib.checkpoint`` calls.

A plan (``ckptlib.schedules``) is a tuple of steps: a layer index runs that
layer normally; a ``Segment`` runs its layers inside one ``checkpoint`` whose
function follows the segment's own body, so segments inside it become
checkpoints nested in it. Autograd then does the whole backward: each frame
made in the first forward reruns once when backward reaches it, restoring the
inputs of the frames nested in it, and early stop ends every rerun at its
last needed tensor. ``Plan.actions`` is that training step written out;
``tests/schedules/test_sequential.py`` checks that counted module calls follow it.

With an int, ``checkpoint_sequential`` is ``torch.utils.checkpoint.checkpoint_sequential``:
the same segments (``schedules.uniform``), the same outputs and gradients.
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Callable, Sequence, Union

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ckptlib._arguments import check_not_reentrant, flag, integer
from ckptlib.core.checkpoint import checkpoint
from ckptlib.core.checks import storage_ptr, storage_ptrs
from ckptlib.memory.allocations import storage_bytes
from ckptlib.schedules import LayerCost, Plan, Segment, Step, uniform

__all__ = ["checkpoint_sequential", "measure_layer_costs"]

Modules = Union[nn.Sequential, nn.ModuleList, Sequence[Callable[[Any], Any]]]


def checkpoint_sequential(
    modules: Modules,
    segments_or_plan: int | Plan,
    input: Any,
    *,
    layer_kwargs: dict[str, Any] | None = None,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
) -> Any:
    """Run ``input`` through ``modules`` in order, checkpointing as ``segments_or_plan`` says.

    Args:
        modules: an ``nn.Sequential``, an ``nn.ModuleList``, or a list or tuple
            of modules (or callables); each one's output is the next one's input.
        segments_or_plan: an int ``k``: as ``torch.utils.checkpoint.checkpoint_sequential``,
            ``k`` segments of which all but the last are checkpointed
            (``schedules.uniform(len(modules), k)``); or a ``schedules.Plan``
            for ``len(modules)`` layers, e.g. ``revolve(len(modules), 3)``.
        input: the first module's input.
        layer_kwargs: keyword arguments every module is called with, in forward and in
            the reruns: ``module(x, **layer_kwargs)`` (an attention mask, Llama's
            ``position_embeddings``).
        preserve_rng_state: passed to every ``checkpoint`` (dropout replays its masks).
        use_reentrant: accepted for drop-in compatibility; only ``None``/``False``.

    Gradients equal plain autograd's bitwise. In one training step the modules
    are called ``plan.forward_calls`` times, ``plan.forward_steps`` of them in
    recomputations.

    >>> import torch, torch.nn as nn
    >>> from ckptlib.schedules import revolve
    >>> _ = torch.manual_seed(0)
    >>> chain = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(6)))
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> checkpoint_sequential(chain, revolve(6, 2), x).sum().backward()
    >>> checkpointed = x.grad.clone(); x.grad = None
    >>> chain(x).sum().backward()
    >>> torch.equal(checkpointed, x.grad)
    True
    >>> checkpoint_sequential(chain, 7, x)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: checkpoint_sequential: segments=7 must be between 1 and the number of modules (6);
    with k segments, the first k-1 are checkpointed.
    """
    layers = _as_layers(modules)
    if not layers:
        raise ValueError("checkpoint_sequential: modules is empty; pass at least one module "
                         "(an empty chain has nothing to run or checkpoint: use the input as it "
                         "is).")
    plan = _as_plan(segments_or_plan, len(layers))
    flag(preserve_rng_state, "preserve_rng_state", where="checkpoint_sequential")
    check_not_reentrant("checkpoint_sequential", use_reentrant,
                        "torch.utils.checkpoint.checkpoint_sequential")
    return _run(plan.body, layers, input, _checked_kwargs(layer_kwargs, "checkpoint_sequential"),
                preserve_rng_state)


Layers = Union[list[Callable[..., Any]], dict[int, Callable[..., Any]]]   # by index in the chain


def _run(steps: tuple[Step, ...], layers: Layers, x: Any, kwargs: dict[str, Any],
         preserve_rng_state: bool) -> Any:
    for step in steps:
        if isinstance(step, Segment):
            # The keyword arguments go through checkpoint as an input, so a tensor among them is
            # kept.
            inputs = (x, kwargs) if kwargs else (x,)
            x = checkpoint(_segment_function(step, layers, preserve_rng_state), *inputs,
                           preserve_rng_state=preserve_rng_state)
        else:
            x = _call_layer(layers, step, x, kwargs)
    return x


def _call_layer(layers: Layers, index: int, x: Any, kwargs: dict[str, Any]) -> Any:
    """``layers[index](x, **kwargs)``; a layer that fails on a tuple it was handed gets a note.

    Each layer's output is the next layer's one input, as it is (as in torch's
    ``checkpoint_sequential`` and ``nn.Sequential``): a tuple is not unpacked into arguments. A
    layer written for a tensor then fails deep inside with ``'tuple' object has no attribute
    'size'``; the note says where the tuple came from and what to do. The error itself is left as
    it is, so code that catches it still does.
    """
    try:
        return layers[index](x, **kwargs)
    except (AttributeError, TypeError) as error:
        if isinstance(x, (tuple, list)):
            kind = type(x).__name__
            source = "the input" if index == 0 else f"what modules[{index - 1}] returned"
            error.add_note(
                f"checkpoint_sequential: modules[{index}] was called with a {kind} ({source}) "
                "as its one argument. Each module's output is passed on as the next one's single "
                "input, as in torch.utils.checkpoint.checkpoint_sequential: make "
                f"modules[{index}] take the {kind}, or have the module before it return one "
                "tensor.")
        raise


def _segment_function(segment: Segment, layers: Layers,
                      preserve_rng_state: bool) -> Callable[..., Any]:
    # The function holds only the segment's own layers: the checkpoint's guards watch the modules
    # its function reaches, and a BatchNorm in a later segment is none of this one's business.
    own_layers = {index: layers[index] for index in range(segment.start, segment.stop)}

    def run_segment(x: Any, kwargs: dict[str, Any] | None = None) -> Any:
        return _run(segment.body, own_layers, x, kwargs or {}, preserve_rng_state)

    # checkpoint names its region after the function: traces then read "layers[4:8]@12".
    run_segment.__qualname__ = f"layers[{segment.start}:{segment.stop}]"
    return run_segment


def _as_layers(modules: Modules) -> list[Callable[[Any], Any]]:
    if isinstance(modules, (nn.Sequential, nn.ModuleList, list, tuple)):
        layers = list(modules)
    else:
        raise TypeError(
            "checkpoint_sequential: modules must be an nn.Sequential, an nn.ModuleList or a "
            f"list of modules, got {type(modules).__name__}. To checkpoint one module, call "
            "ckptlib.checkpoint(module, x); to split a model, pass its layers as a list."
        )
    for position, layer in enumerate(layers):
        if not callable(layer):
            raise TypeError(f"checkpoint_sequential: modules[{position}] is not a module or "
                            f"function (got {type(layer).__name__}); every item must be callable "
                            "on the previous output.")
    return layers


def _as_plan(segments_or_plan: int | Plan, n: int) -> Plan:
    if isinstance(segments_or_plan, Plan):
        if segments_or_plan.n != n:
            raise ValueError(f"checkpoint_sequential: the plan {segments_or_plan.name} is for "
                             f"{segments_or_plan.n} layers, but there are {n} modules; "
                             f"build the plan for n={n}.")
        return segments_or_plan
    # A NumPy integer counts as an int (as torch's checkpoint_sequential takes it); a bool does not.
    if isinstance(segments_or_plan, bool) or not isinstance(segments_or_plan, numbers.Integral):
        raise ValueError("checkpoint_sequential: segments must be an int (the number of "
                         "segments) or a ckptlib.schedules.Plan, "
                         f"got {segments_or_plan!r} "
                         f"({type(segments_or_plan).__name__}).")
    segments = int(segments_or_plan)
    if not 1 <= segments <= n:
        raise ValueError(f"checkpoint_sequential: segments={segments} must be between 1 and the "
                         f"number of modules ({n}); with k segments, the first k-1 are "
                         "checkpointed.")
    return uniform(n, segments)


def _checked_kwargs(layer_kwargs: Any, where: str) -> dict[str, Any]:
    if layer_kwargs is None:
        return {}
    if not isinstance(layer_kwargs, dict) or not all(
            isinstance(name, str) for name in layer_kwargs):
        raise TypeError(f"{where}: layer_kwargs must be a dict of keyword arguments for every "
                        f"layer, e.g. {{'attention_mask': mask}}, or None; "
                        f"got {type(layer_kwargs).__name__}.")
    return layer_kwargs


def measure_layer_costs(modules: Modules, input: Any, *, repeat: int = 3,
                        layer_kwargs: dict[str, Any] | None = None) -> list[LayerCost]:
    """Measure each layer's ``LayerCost`` (input bytes, saved bytes, forward seconds) on ``input``.

    Each layer runs on a detached copy of the previous layer's output (floating
    point inputs require grad, as inside a network). ``saved_bytes`` adds up the
    storages autograd saves for the layer's backward, its input included and its
    parameters and buffers excluded; ``forward_s`` is the fastest of ``repeat``
    forward calls with grad enabled. The result feeds ``schedules.plan_for_budget``.
    Each layer is called as ``layer(x, **layer_kwargs)``; tensors in ``layer_kwargs`` (a mask)
    are the caller's, alive through the step, and not counted.

    >>> import torch, torch.nn as nn
    >>> costs = measure_layer_costs(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(4, 8))
    >>> [(cost.input_bytes, cost.saved_bytes) for cost in costs]    # 4 x 8 float32 = 128 bytes
    [(128, 128), (128, 128)]
    """
    integer(repeat, "repeat", least=1, where="measure_layer_costs")
    layers = _as_layers(modules)
    if not layers:
        raise ValueError("measure_layer_costs: modules is empty; pass the layers to measure.")
    kwargs = _checked_kwargs(layer_kwargs, "measure_layer_costs")
    shared = storage_ptrs(_tensors(kwargs))
    costs = []
    x = _fresh_input(input)
    for layer in layers:
        own = shared | storage_ptrs(_state_tensors(layer))
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            ptr = storage_ptr(tensor)
            if ptr is not None and ptr not in own:
                saved[ptr] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = layer(x, **kwargs)
            seconds = []
            for _ in range(repeat):
                _synchronize(output)
                began = time.perf_counter()
                layer(x, **kwargs)
                _synchronize(output)
                seconds.append(time.perf_counter() - began)
        costs.append(LayerCost(_storage_bytes(x), sum(saved.values()), min(seconds)))
        x = _fresh_input(output)
    return costs


def _state_tensors(layer: Any) -> list[torch.Tensor]:
    if isinstance(layer, nn.Module):
        return [*layer.parameters(), *layer.buffers()]
    return []


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _fresh_input(value: Any) -> Any:
    """``value`` cut from its graph; floating point tensors require grad as activations do."""
    def fresh(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.detach().requires_grad_(leaf.is_floating_point() or leaf.is_complex())

    return tree_map(fresh, value)


def _storage_bytes(value: Any) -> int:
    return sum(storage_bytes(value).values())


def _synchronize(value: Any) -> None:
    for tensor in _tensors(value):
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
            return
