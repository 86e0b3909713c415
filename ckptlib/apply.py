"""Checkpointing a user's own model: choose submodules, wrap their ``forward``, undo it later.

Design notes
============

Which modules. A model is a tree of modules named by path (``transformer.h.1``,
as ``model.named_modules()`` spells it). ``select`` picks some of them: a module
class (``GPT2Block``), a path pattern (``"transformer.h.*"``, shell-style, as
``fnmatch``), a predicate ``(path, module) -> bool``, a plan from
``plan_checkpointing``, or, by default, *every repeated stack*: the children of each
``nn.ModuleList`` / ``nn.Sequential`` whose two or more children are blocks (modules
with modules inside) of one class: a Transformer's layers, T5's encoder and decoder
both. A model with no such stack gets the longest stack of single layers (a
``Sequential`` of ``Linear`` s). A selected module
inside another selected module is left alone: the outer checkpoint already drops
its activations. ``every_n=k`` then keeps every k-th of them, the first included
(Hugging Face's ``every_n_layers`` counts the same way).

A plan from ``plan_checkpointing(..., peak_bytes=...)`` says, per module, *how*: full,
a selective policy, or offloading; each module is wrapped its own way, and the
selective ones share one ``SelectivePlans``, so after the first step their forward
runs without a dispatch mode (the time the planner measured).

How they are wrapped. Each chosen module gets an *instance* attribute ``forward``
that runs the original ``forward`` inside ``ckptlib.checkpoint`` (or a selective
checkpoint, or under offloading). ``nn.Module.__call__`` looks ``forward`` up on
the instance first, so the module's hooks (DDP's, FSDP2's, a memory meter's) stay
outside the checkpoint and run once, as Hugging Face does it. No wrapper module is
inserted, so ``state_dict`` keys and ``named_parameters`` stay as they were, and
removing the attribute gives the module its own ``forward`` back.

Copies. A copy of a checkpointed model is checkpointed too, and runs its own layers:
``copy.deepcopy`` (an EMA or teacher copy, ``AveragedModel``, ``nn.TransformerEncoder``'s
clones of its layer), ``pickle`` and ``torch.save`` rebuild each wrapper around the copied
module (``_Wrapper.__reduce__``), as they rebuild the module's own attributes; the copy's handle
holds no model, so ``remove_checkpointing(copy)`` is how to undo a copy. ``copy.copy`` shares, as
on a plain model, the submodules and so their wrappers; a shallow copy of a module that is itself
wrapped runs the original's ``forward`` on the same parameters and submodules (its own
instance attributes, ``training`` included, are not read).

Names. The function handed to ``checkpoint`` is called after the module's path,
so traces and errors read ``checkpoint transformer.h.1@13: ...``.

Arguments. Positional and keyword arguments (attention masks, Llama's
``position_embeddings``) go through ``checkpoint`` as one pytree, so tensors among
them are kept as inputs and nothing clashes with ``checkpoint``'s own keywords.
A Hugging Face cache cannot be: the rerun in backward would append the layer's
keys and values to it a second time. So the checkpointed call gets no cache
(``None`` in its place, ``use_cache=False``), as Hugging Face's own switch does,
and a warning says so once, naming ``use_cache=False``, the way to silence it.

``torch.compile``. ``checkpoint`` runs eagerly: Dynamo breaks the graph at each
checkpointed module. The wrapper says so once, with the count and the
alternatives; under ``fullgraph=True`` Dynamo refuses with the reason.
"""
from __future__ import annotations

import fnmatch
import functools
import types
import warnings
from typing import Any, Callable, Union

import torch
import torch.nn as nn
from torch._ops import OpOverload, OpOverloadPacket

from ckptlib._arguments import integer
from ckptlib.core.errors import CheckpointError
from ckptlib.core.checkpoint import checkpoint
from ckptlib.core.compile import run_eagerly_under_dynamo
from ckptlib.offload import offload_saved_tensors
from ckptlib.schedules import Plan
from ckptlib.selective import SelectivePlans, selective_checkpoint
from ckptlib.selective.policy import as_predicate, policy_name
from ckptlib.sequential import checkpoint_sequential

__all__ = ["apply_checkpointing", "remove_checkpointing", "Checkpointed", "repeated_layers",
           "repeated_stacks"]

Selector = Union[None, str, type, tuple, list, Callable[[str, nn.Module], bool]]
HOWS = ("full", "offload")


def apply_checkpointing(
    model: nn.Module,
    select: Selector = None,
    *,
    how: Any = "full",
    every_n: int = 1,
    plans: Any = None,
    preserve_rng_state: bool = True,
) -> "Checkpointed":
    """Checkpoint the chosen submodules of ``model`` in place; returns a handle that undoes it.

    Args:
        model: any ``nn.Module`` (a Hugging Face model included).
        select: which submodules: ``None`` for every repeated stack (see
            :func:`repeated_stacks`), a module class or tuple of classes, a path pattern or
            list of patterns (``"transformer.h.*"``), a predicate ``(path, module) -> bool``,
            or a plan from :func:`plan_checkpointing` (a step-peak plan also says how, per
            module; ``how`` is then ignored).
        how: ``"full"`` (``ckptlib.checkpoint``), a ``Plan`` over the selected layers (its
            layer i is the i-th selected module; a segment of several layers needs them to be
            the children of an ``nn.Sequential``), ``"offload"`` (keep saved tensors in
            CPU memory, ``offload_saved_tensors``), or a selective policy
            (``ckptlib.save_matmuls``, ``ckptlib.megatron_attention``, ...). Offloading on a
            model that lives on the CPU warns: its saved tensors are in host memory already.
        every_n: checkpoint every n-th selected module, the first included.
        plans: a ``SelectivePlans`` for a selective ``how`` (reused plans per module).
        preserve_rng_state: as for ``ckptlib.checkpoint``.

    ``state_dict`` keys and parameters are unchanged; gradients equal plain autograd's.
    Undo with ``handle.remove()``, ``ckptlib.remove_checkpointing(model)``, or use the
    handle as a context manager.

    >>> import torch, ckptlib
    >>> model = ckptlib.TinyTransformer(depth=3)
    >>> keys = list(model.state_dict())
    >>> with ckptlib.apply_checkpointing(model) as handle:
    ...     print(handle)
    ...     loss = model.training_step()
    ...     list(model.state_dict()) == keys
    module    how   kept bytes  rerun cost
    blocks.0  full           -           -
    blocks.1  full           -           -
    blocks.2  full           -           -
    True
    >>> "forward" in vars(model.blocks[0])        # removed again: the class's forward
    False
    """
    if not isinstance(model, nn.Module):
        raise TypeError("apply_checkpointing: model must be an nn.Module, "
                        f"got {type(model).__name__}. "
                        "To checkpoint a function, call ckptlib.checkpoint(fn, *args).")
    _check_how(how)
    integer(every_n, "every_n", least=1, where="apply_checkpointing")
    chosen = selected_modules(model, select)[::every_n]
    if isinstance(how, Plan):
        return _apply_plan(model, chosen, how, every_n, preserve_rng_state)
    hows = _hows_of(select, chosen, how)
    if "offload" in hows.values():
        _warn_if_offloading_frees_nothing(model)
    if plans is None and hasattr(select, "module_hows"):
        plans = SelectivePlans()   # the planner timed selective layers with reused plans
    handle = Checkpointed(model, how, plan=select if hasattr(select, "module_hows") else None)
    for path, module in chosen:
        _refuse_double_checkpointing(path, module)
        _refuse_wrapped(path, module, model)
    for path, module in chosen:
        _wrap(module, path, hows[path], plans, preserve_rng_state, handle)
    return handle


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo every :func:`apply_checkpointing` on ``model``'s modules; returns the paths restored.

    >>> import ckptlib
    >>> model = ckptlib.TinyTransformer(depth=2)
    >>> _ = ckptlib.apply_checkpointing(model, "blocks.1")
    >>> ckptlib.remove_checkpointing(model)
    ['blocks.1']
    """
    restored = []
    for path, module in model.named_modules():
        wrapper = _wrapper_of(module)
        if wrapper is not None:
            wrapper.restore(module)
            restored.append(path)
    return restored


class Checkpointed:
    """What :func:`apply_checkpointing` did: the module paths wrapped, and how; undo with
    :meth:`remove`."""

    def __init__(self, model: nn.Module, how: Any, plan: Any = None) -> None:
        self.model: nn.Module | None = model   # None in a copy (see __getstate__)
        self.how = how
        self.plan = plan                # a step-peak plan: its bytes, costs and measured peak
        self.paths: list[str] = []
        self.hows: dict[str, Any] = {}  # path -> how that module is checkpointed
        self.warned: set[str] = set()   # which one-time warnings this handle has given

    def remove(self) -> None:
        """Give every module this handle wrapped its own ``forward`` back (``paths`` still says
        which)."""
        if self.model is None:
            raise ValueError("this handle came with a copy of a checkpointed model (copy.deepcopy, "
                             "pickle) and holds no model; undo the copy's checkpointing with "
                             "ckptlib.remove_checkpointing(copy).")
        for path in self.paths:
            module = self.model.get_submodule(path)
            wrapper = _wrapper_of(module)
            if wrapper is not None and wrapper.handle is self:
                wrapper.restore(module)

    def __getstate__(self) -> dict[str, Any]:
        # A copy of a checkpointed module (copy.deepcopy, pickle) copies its wrappers and so this
        # handle; without the model, or a deep copy of one layer would copy the whole model it came
        # from. The copy's wrappers still warn once each; remove_checkpointing(copy) undoes them.
        # The step-peak plan measured the original model; a copy keeps the hows, not the plan.
        return {**self.__dict__, "model": None, "how": _picklable(self.how), "plan": None,
                "hows": {path: _picklable(how) for path, how in self.hows.items()}}

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=4)

    def __enter__(self) -> "Checkpointed":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __len__(self) -> int:
        return len(self.paths)

    def __str__(self) -> str:
        """A table: module, how, bytes it keeps for backward and its rerun cost (known from a
        step-peak plan, else ``-``), and the plan's measured step peak."""
        if not self.paths:
            return "checkpointed: nothing"
        rows = [("module", "how", "kept bytes", "rerun cost")]
        for path in self.paths:
            kept, cost = self.plan.cost_of(path) if self.plan is not None else ("-", "-")
            how = self.how if isinstance(self.how, Plan) else self.hows[path]   # the plan's name
            rows.append((path, how_name(how), kept, cost))
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  "
                 f"{row[3]:>{widths[3]}}" for row in rows]
        if self.plan is not None:
            lines.append(self.plan.peak_line())
        return "\n".join(lines)

    __repr__ = __str__


def how_name(how: Any) -> str:
    """How a module is checkpointed, in a word or two: ``full``, ``offload``, ``keep``,
    ``selective save_matmuls``, ``plan <name>``."""
    if isinstance(how, str):
        return how
    if isinstance(how, Plan):
        return f"plan {how.name}"
    return f"selective {policy_name(how)}"


# ---------------------------------------------------------------------------
# Choosing modules
# ---------------------------------------------------------------------------


def repeated_stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of every ``ModuleList``/``Sequential`` whose two or more children are blocks
    of one class (modules with modules inside), outermost stacks only; with no such stack, the
    longest stack of single layers (:func:`repeated_layers`).

    T5 has two stacks, its encoder's blocks and its decoder's: both are chosen, as Hugging Face's
    own switch chooses them.

    >>> import ckptlib
    >>> [path for path, _ in repeated_stacks(ckptlib.TinyTransformer(depth=2))]
    ['blocks.0', 'blocks.1']
    """
    found: list[tuple[str, nn.Module]] = []
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        if (len(children) >= 2 and len({type(child) for _, child in children}) == 1
                and all(next(child.children(), None) is not None for _, child in children)):
            found += [(f"{path}.{name}" if path else name, child) for name, child in children]
    return _outermost(found) or repeated_layers(model)


def repeated_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the longest ``ModuleList``/``Sequential`` whose children share one class.

    >>> import ckptlib
    >>> [path for path, _ in repeated_layers(ckptlib.TinyTransformer(depth=2))]
    ['blocks.0', 'blocks.1']
    """
    best: list[tuple[str, nn.Module]] = []
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        if len(children) > max(len(best), 1) and len({type(child) for _, child in children}) == 1:
            best = [(f"{path}.{name}" if path else name, child) for name, child in children]
    return best


def selected_modules(model: nn.Module, select: Selector) -> list[tuple[str, nn.Module]]:
    """(path, module) of what ``select`` chooses in ``model``, outermost only (a chosen module
    inside another chosen one is left out: its parent's checkpoint covers it)."""
    return _outermost(_selected(model, select))


def _selected(model: nn.Module, select: Selector) -> list[tuple[str, nn.Module]]:
    paths_of = getattr(select, "module_paths", None)   # a plan from plan_checkpointing
    if paths_of is not None:
        select = list(paths_of())
        if not select:
            return []
    if select is None:
        found = repeated_stacks(model)
        if not found:
            raise ValueError(f"apply_checkpointing: {type(model).__name__} has no ModuleList or "
                             "Sequential of repeated layers; choose modules with a class, a path "
                             "pattern such as 'encoder.layers.*', or a predicate "
                             "(path, module) -> bool.")
        return found
    test = _matcher(select)
    found = [(path, module) for path, module in model.named_modules() if test(path, module)]
    if not found:
        some = [path for path, _ in model.named_modules() if path][:6]
        raise ValueError(f"apply_checkpointing: select={select!r} matches no module of "
                         f"{type(model).__name__}; its modules are named like "
                         f"{', '.join(some)}, ... (model.named_modules()).")
    return found


def _matcher(select: Selector) -> Callable[[str, nn.Module], bool]:
    if isinstance(select, str):
        select = [select]
    if isinstance(select, type) or (
            isinstance(select, tuple) and all(isinstance(s, type) for s in select)):
        return lambda path, module: isinstance(module, select)
    if isinstance(select, (list, tuple)) and all(isinstance(s, str) for s in select):
        patterns = list(select)
        return lambda path, module: any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)
    if callable(select):
        return lambda path, module: bool(select(path, module))
    raise TypeError("apply_checkpointing: select must be None, a module class, a path pattern "
                    "(or a list of them), or a predicate (path, module) -> bool; "
                    f"got {type(select).__name__}.")


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop modules nested in another selected module (its checkpoint already covers them)."""
    kept: list[tuple[str, nn.Module]] = []
    for path, module in found:
        if not any(path.startswith(outer + ".") or (outer == "" and path) for outer, _ in kept):
            kept.append((path, module))
    return kept


def _check_how(how: Any) -> None:
    if isinstance(how, Plan):
        return
    if isinstance(how, str):
        if how not in HOWS:
            raise ValueError(f"apply_checkpointing: how={how!r} is not known; use 'full', "
                             "'offload', or a selective policy such as ckptlib.save_matmuls.")
        return
    try:
        as_predicate(how)
    except (TypeError, ValueError) as error:
        raise TypeError("apply_checkpointing: how must be 'full', 'offload' or a selective "
                        f"policy: {error}") from None


def _apply_plan(model: nn.Module, chosen: list[tuple[str, nn.Module]], plan: Plan, every_n: int,
                preserve_rng_state: bool) -> "Checkpointed":
    """``how=plan``: the selected layers, in order, are the plan's layers 0 .. n-1.

    A plan whose segments hold one layer each (``uniform(n, n)``, or some layers kept) becomes one
    checkpoint per segment's layer, called by the model's own loop with its own arguments. A
    segment of several layers needs one call for all of them: the module that holds them must be
    an ``nn.Sequential`` (its forward then runs ``checkpoint_sequential(layers, plan, x)``); in a
    ``ModuleList`` the model's loop calls each layer itself, so such a plan is refused.
    """
    where = "apply_checkpointing(how=plan)"
    if every_n != 1:
        raise ValueError(f"{where}: every_n={every_n} and a plan both say which layers to "
                         "checkpoint; give one (the plan's segments choose the layers).")
    if len(chosen) != plan.n:
        raise ValueError(f"{where}: the plan is for {plan.n} layers and select chose "
                         f"{len(chosen)} ({', '.join(p for p, _ in chosen[:4])}, ...); make a plan "
                         f"for {len(chosen)} layers, e.g. ckptlib.sqrt_n({len(chosen)}).")
    handle = Checkpointed(model, plan)
    single = all(isinstance(step, int) or step.stop - step.start == 1 for step in plan.body)
    if single:
        checkpointed = {step.start for step in plan.body if not isinstance(step, int)}
        layers = [(path, module) for i, (path, module) in enumerate(chosen) if i in checkpointed]
        for path, module in layers:
            _refuse_double_checkpointing(path, module)
            _refuse_wrapped(path, module, model)
        for path, module in layers:
            _wrap(module, path, "full", None, preserve_rng_state, handle)
        return handle
    parent_path = chosen[0][0].rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    if not (isinstance(parent, nn.Sequential) and [m for _, m in chosen] == list(parent)):
        raise ValueError(
            f"{where}: the plan ({plan.name}) has segments of several layers, which run as one "
            f"checkpoint; {parent_path or type(model).__name__} is a {type(parent).__name__}, "
            "whose layers the model's own loop calls one by one (with their own arguments), so "
            "no single call spans a segment. Use a plan of one-layer segments here "
            f"(ckptlib.uniform({plan.n}, {plan.n}): every layer but the last; or how='full' for "
            "every layer), or call ckptlib.checkpoint_sequential(layers, plan, x, "
            "layer_kwargs=...) in the model's forward.")
    _refuse_double_checkpointing(parent_path, parent)
    _refuse_wrapped(parent_path, parent, model)
    _wrap(parent, parent_path, plan, None, preserve_rng_state, handle)
    return handle


def _hows_of(select: Selector, chosen: list[tuple[str, nn.Module]], how: Any) -> dict[str, Any]:
    """path -> how for each chosen module: a step-peak plan's own choice per module, else
    ``how``."""
    hows_of = getattr(select, "module_hows", None)
    if hows_of is None:
        return {path: how for path, _ in chosen}
    hows = hows_of()
    for each in hows.values():
        _check_how(each)
    return {path: hows[path] for path, _ in chosen}


def _warn_if_offloading_frees_nothing(model: nn.Module) -> None:
    devices = {t.device.type for t in (*model.parameters(), *model.buffers())}
    if devices <= {"cpu"}:
        warnings.warn(
            f"apply_checkpointing(how='offload'): {type(model).__name__} lives on the CPU, where "
            "its saved tensors already are: offloading frees nothing (and copies nothing). To "
            "save memory here, use how='full' or a selective policy such as "
            "ckptlib.save_matmuls; offload a model on a GPU.", UserWarning, stacklevel=3)


def _refuse_wrapped(path: str, module: nn.Module, model: nn.Module) -> None:
    if _wrapper_of(module) is not None:
        raise ValueError(f"apply_checkpointing: {path or type(model).__name__} is already "
                         "checkpointed by ckptlib; call ckptlib.remove_checkpointing(model) "
                         "before applying again.")


def _refuse_double_checkpointing(path: str, module: nn.Module) -> None:
    # read per call: cheap
    if getattr(module, "gradient_checkpointing", False) is True and module.training:
        raise CheckpointError(
            f"{path}: Hugging Face's gradient checkpointing is on for this layer as well, so it "
            "would be checkpointed twice (rerun twice in backward). Call "
            "model.activation_checkpointing_disable() (before transformers 5: "
            "model.gradient_checkpointing_disable()) before ckptlib.apply_checkpointing(model), "
            "or use only Hugging Face's switch. Under a Trainer, the switch is turned on by "
            "TrainingArguments(activation_checkpointing=True) (gradient_checkpointing=True, its "
            "deprecated alias): leave it False when ckptlib checkpoints the model.")


# ---------------------------------------------------------------------------
# Wrapping one module
# ---------------------------------------------------------------------------


class _Wrapper:
    """The instance ``forward`` of one checkpointed module, and what to put back.

    It holds its module (strongly: the module holds it too, so they live and die together) and
    runs that module's own ``forward``. A copy of the module (``copy.deepcopy``,
    ``torch.optim.swa_utils.AveragedModel``, the layer clones of ``nn.TransformerEncoder``,
    ``pickle``, ``torch.save``) copies its ``__dict__``, this wrapper included: ``__reduce__``
    makes the copy's wrapper anew from the copied module, so the copy runs its own layers with its
    own weights. (A wrapper copied attribute by attribute would keep the original's bound
    ``forward``.)
    """

    def __init__(self, module: nn.Module, path: str, how: Any, plans: Any,
                 preserve_rng_state: bool, handle: Checkpointed, own_forward: Any) -> None:
        self.path, self.how, self.plans, self.handle = path, how, plans, handle
        self.preserve_rng_state = preserve_rng_state
        self.module = module
        # an instance forward someone else had set (accelerate's hooks); None: the class's
        self.own_forward = own_forward
        # Bound here from the class, not read as module.forward: while a copy is being built its
        # __dict__ is still empty (and once wrapped, module.forward is this wrapper).
        inner = own_forward if own_forward is not None else types.MethodType(type(module).forward,
                                                                             module)

        def region(args: tuple, kwargs: dict) -> Any:
            return inner(*args, **kwargs)

        # checkpoint names its region after the function: errors and traces read
        # "transformer.h.1@13".
        region.__qualname__ = region.__name__ = path or type(module).__name__
        self.region = region

    def __reduce__(self) -> tuple:
        # copy.deepcopy and pickle copy these arguments (the module among them: its copy, through
        # their memo) and call _Wrapper with them.
        return (_Wrapper, (self.module, self.path, _picklable(self.how), self.plans,
                           self.preserve_rng_state, self.handle, self.own_forward))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.checkpoints_itself():   # Hugging Face's switch, turned on after apply_checkpointing
            _refuse_double_checkpointing(self.path, self.module)
        if torch.compiler.is_compiling():
            return _run_under_compile(self, args, kwargs)
        if torch.is_grad_enabled():
            args, kwargs = _without_cache(self, args, kwargs)
        return self.run(args, kwargs)

    def checkpoints_itself(self) -> bool:
        module = self.module
        return getattr(module, "gradient_checkpointing", False) is True and module.training

    def run(self, args: tuple, kwargs: dict) -> Any:
        if isinstance(self.how, Plan):   # an nn.Sequential run under the plan
            if kwargs or len(args) != 1:
                raise TypeError(f"apply_checkpointing(how=plan): {self.path} is an nn.Sequential "
                                "run under a plan; it takes one input, got "
                                f"{len(args)} arguments and {sorted(kwargs)} keywords.")
            return checkpoint_sequential(list(self.module), self.how, args[0],
                                         preserve_rng_state=self.preserve_rng_state)
        if self.how == "full":
            return checkpoint(self.region, args, kwargs, preserve_rng_state=self.preserve_rng_state)
        if self.how == "offload":
            with offload_saved_tensors():
                return self.region(args, kwargs)
        return selective_checkpoint(self.region, args, kwargs, policy=self.how, plans=self.plans,
                                    preserve_rng_state=self.preserve_rng_state)

    def restore(self, module: nn.Module) -> None:
        if self.own_forward is None:
            del module.forward
        else:
            module.forward = self.own_forward


def _wrap(module: nn.Module, path: str, how: Any, plans: Any, preserve_rng_state: bool,
          handle: Checkpointed) -> None:
    wrapper = _Wrapper(module, path, how, plans, preserve_rng_state, handle,
                       module.__dict__.get("forward"))
    # an instance attribute: nn.Module.__call__ finds it before the class's
    module.forward = wrapper
    handle.paths.append(path)
    handle.hows[path] = how


class _OpByName:
    """An aten op as pickle can write it, by its name: torch's op objects do not pickle, and a
    selective ``how`` may be a collection of them (``ckptlib.save_matmuls``)."""

    def __init__(self, op: OpOverload | OpOverloadPacket) -> None:
        self.name = str(op)   # "aten.mm.default"

    def __reduce__(self) -> tuple:
        return (_aten_op, (self.name,))


def _aten_op(name: str) -> OpOverload | OpOverloadPacket:
    return functools.reduce(getattr, name.split("."), torch.ops)


def _picklable(how: Any) -> Any:
    """``how`` with each aten op in it by name (:class:`_OpByName`); a copy has the ops again."""
    if isinstance(how, (OpOverload, OpOverloadPacket)):
        return _OpByName(how)
    if type(how) in (set, frozenset, list, tuple):   # a collection of ops
        return type(how)(_OpByName(op) if isinstance(op, (OpOverload, OpOverloadPacket)) else op
                         for op in how)
    return how


def _wrapper_of(module: nn.Module) -> _Wrapper | None:
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, _Wrapper) else None


# ---------------------------------------------------------------------------
# Hugging Face's cache, and torch.compile
# ---------------------------------------------------------------------------


def _is_hf_cache(value: Any) -> bool:
    """A ``transformers`` cache object (``DynamicCache`` ...), known without importing
    transformers."""
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
               for cls in type(value).__mro__)


def _without_cache(wrapper: _Wrapper, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with any Hugging Face cache replaced by ``None`` and
    ``use_cache=False``."""
    caches = [type(a).__name__ for a in (*args, *kwargs.values()) if _is_hf_cache(a)]
    if not caches and not kwargs.get("use_cache"):
        return args, kwargs
    args = tuple(None if _is_hf_cache(a) else a for a in args)
    kwargs = {name: (None if _is_hf_cache(value) else value) for name, value in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    if caches:
        wrapper.handle.warn_once("cache", (
            f"apply_checkpointing: {wrapper.path} was called with a Hugging Face cache "
            f"({caches[0]}); the rerun in backward would append to it a second time, so the "
            "checkpointed layers run without it. Pass use_cache=False to the model when training "
            "to silence this warning."))
    return args, kwargs


def _run_under_compile(wrapper: _Wrapper, args: tuple, kwargs: dict) -> Any:
    """Dynamo breaks the graph here (this function is marked as not traced) and runs it eagerly."""
    count = len(wrapper.handle.paths)
    wrapper.handle.warn_once("compile", (
        f"apply_checkpointing under torch.compile: each of the {count} checkpointed modules "
        f"({wrapper.handle.paths[0]}, ...) runs eagerly between compiled graphs, "
        f"{count} graph breaks per forward: nothing inside them is compiled or fused, "
        "and each break costs a return to Python. "
        "For one compiled graph, remove_checkpointing(model) and let the compiler recompute: "
        "torch.utils.checkpoint (Hugging Face's gradient_checkpointing_enable()) or "
        "torch._functorch.config.activation_memory_budget, with fullgraph=True."))
    args, kwargs = _without_cache(wrapper, args, kwargs)
    return wrapper.run(args, kwargs)


# Dynamo breaks the graph at this call and runs it eagerly (as for ckptlib.checkpoint itself,
# ckptlib/core/compile.py); under fullgraph=True it refuses with this message.
run_eagerly_under_dynamo(_run_under_compile, reason=(
    "a module checkpointed by ckptlib.apply_checkpointing runs eagerly under torch.compile: drop "
    "fullgraph=True, or remove_checkpointing(model) and use torch.utils.checkpoint inside a "
    "fullgraph region."))
