"""Checking the arguments of a public function: one clear error per misuse, raised at the call.

Every public function of ckptlib checks its arguments with these helpers. Each check returns
the value it accepted (numbers as plain Python ``int`` or ``float``, so a NumPy integer behaves
like any other) or raises:

* ``TypeError`` for a value of the wrong kind (``width="8"``, ``on_op="print"``),
* ``ValueError`` for a value of the right kind that is out of range (``depth=0``, a NaN budget).

The message starts with where the argument was given, names it, says what it accepts and
repeats what it got: ``MLPChain: width must be an integer >= 1, got '8' (str).`` Selective
checkpointing and the bench configuration state the kind and the range in two messages
(``range_apart=True``: ``repeats must be an int, got '3' (str).`` and ``repeats must be at
least 1, got 0 (int).``); their tests and notebooks quote those words.

Why check at the call: an argument used later (a callback on the first op, a size on the first
forward) fails far from the line that was wrong, as an ``AttributeError`` or an error inside
torch, sometimes while a dispatch mode or a hook is installed. And some misuse fails nowhere:
``True`` is an ``int`` to Python, so ``MLPChain(depth=True)`` would quietly build one layer.
Booleans are therefore refused wherever a number is expected.
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable

__all__ = ["got", "integer", "number", "flag", "flags", "function", "qualname",
           "check_not_reentrant"]


def got(value: Any) -> str:
    """``"got '8' (str)"``: the value as the caller wrote it, shortened, with its type.

    >>> got("8"), got(None)
    ("got '8' (str)", 'got None')
    """
    # a tensor or an array: its repr is its values
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"got a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = " ".join(repr(value).split())
    if len(text) > 60:
        text = text[:57] + "..."
    return f"got {text}" if value is None else f"got {text} ({type(value).__name__})"


def _where(where: str) -> str:
    return f"{where}: " if where else ""


def _bound(least: float | None, most: float | None) -> str:
    if least is not None and most is not None:
        return f" between {least} and {most}"
    if least is not None:
        return f" >= {least}"
    return f" <= {most}" if most is not None else ""


def integer(value: Any, name: str, *, least: int | None = None, unit: str = "", where: str = "",
            range_apart: bool = False) -> int:
    """``value`` as an ``int`` when it is an integer (not a bool) of at least ``least``.

    >>> integer(3, "depth", least=1)
    3
    >>> integer(True, "depth", least=1, where="MLPChain")
    Traceback (most recent call last):
    ...
    TypeError: MLPChain: depth must be an integer >= 1, got True (bool).
    >>> integer(0.5, "budget_bytes", least=0, unit="number of bytes")
    Traceback (most recent call last):
    ...
    TypeError: budget_bytes must be an integer number of bytes >= 0, got 0.5 (float).
    >>> integer(0, "repeats", least=1, where="measure_op_costs", range_apart=True)
    Traceback (most recent call last):
    ...
    ValueError: measure_op_costs: repeats must be at least 1, got 0 (int).
    """
    unit = f" {unit}" if unit else ""   # "an integer number of bytes"
    if range_apart:
        wrong_kind = f"{name} must be an int{unit}"
        out_of_range = f"{name} must be at least {least}"
    else:
        wrong_kind = out_of_range = f"{name} must be an integer{unit}{_bound(least, None)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_where(where)}{wrong_kind}, {got(value)}.")
    if least is not None and value < least:
        raise ValueError(f"{_where(where)}{out_of_range}, {got(value)}.")
    return int(value)


def number(value: Any, name: str, *, least: float | None = None, most: float | None = None,
           unit: str = "number", note: str = "", where: str = "",
           range_apart: bool = False) -> int | float:
    """``value`` as an ``int`` or ``float`` when it is a finite real number (not a bool) in range.

    ``note`` says in a few words what the number means; it follows the range in parentheses.

    >>> number(0.5, "dropout", least=0, most=1)
    0.5
    >>> number(float("nan"), "memory_budget", least=0, unit="number of bytes")
    Traceback (most recent call last):
    ...
    ValueError: memory_budget must be a finite number of bytes >= 0, got nan (float).
    >>> number("half", "memory_ratio", least=0, note="a fraction", where="policy_from_costs",
    ...        range_apart=True)
    Traceback (most recent call last):
    ...
    TypeError: policy_from_costs: memory_ratio must be a number (a fraction), got 'half' (str).
    """
    note = f" ({note})" if note else ""
    out_of_range = f"{name} must be a finite {unit}{_bound(least, most)}{note}"
    wrong_kind = f"{name} must be a {unit}{note}" if range_apart else out_of_range
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_where(where)}{wrong_kind}, {got(value)}.")
    if (not math.isfinite(value) or (least is not None and value < least)
            or (most is not None and value > most)):
        raise ValueError(f"{_where(where)}{out_of_range}, {got(value)}.")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def flag(value: Any, name: str, *, where: str = "") -> bool:
    """``value`` when it is ``True`` or ``False`` (``"no"`` is a true value to Python's ``if``).

    >>> flag("no", "timeline", where="MemoryMeter")
    Traceback (most recent call last):
    ...
    TypeError: MemoryMeter: timeline must be True or False, got 'no' (str).
    >>> flag(None, "early_stop", where="checkpoint")
    Traceback (most recent call last):
    ...
    TypeError: checkpoint: early_stop must be True or False, got None (NoneType).
    """
    if not isinstance(value, bool):
        # None says its type here: next to "True or False" it reads as an unset flag, and it is
        # not False.
        shown = "got None (NoneType)" if value is None else got(value)
        raise TypeError(f"{_where(where)}{name} must be True or False, {shown}.")
    return value


def flags(where: str, **values: Any) -> None:
    """:func:`flag` for each keyword:
    ``flags("selective_contexts", replay_random=True, skip_unneeded=False)``."""
    for name, value in values.items():
        flag(value, name, where=where)


def function(value: Any, name: str, *, takes: int, accepts: str, where: str = "") -> Callable:
    """``value`` when it can be called with ``takes`` positional arguments.

    ``accepts`` says what the caller should pass (it ends the message). The signature is
    checked when Python can read it (builtins may hide theirs: those are only called).

    >>> function(lambda entry: None, "on_op", takes=1, accepts="a function of one TimelineEntry")(0)
    >>> function("print", "on_op", takes=1, accepts="a function of one TimelineEntry, or None")
    Traceback (most recent call last):
    ...
    TypeError: on_op must be a function of one TimelineEntry, or None, got 'print' (str).
    """
    if not callable(value):
        raise TypeError(f"{_where(where)}{name} must be {accepts}, {got(value)}.")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return value
    try:
        signature.bind(*range(takes))
    except TypeError as error:
        raise TypeError(f"{_where(where)}{name} must be {accepts}, but it cannot be called with "
                        f"{takes} argument{'s' if takes != 1 else ''} ({error}).") from None
    return value


def qualname(obj: Any) -> str:
    """How an error names a function or callable object: ``block``, ``Block.forward``,
    ``CostPolicy``.

    >>> qualname(len), qualname(qualname), qualname(object())
    ('len', 'qualname', 'object')
    """
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


def check_not_reentrant(where: str, use_reentrant: Any, instead: str) -> None:
    """Accept ``use_reentrant`` ``None`` or ``False`` (for drop-in compatibility); refuse ``True``,
    pointing to ``instead``, the torch function that has the reentrant variant."""
    if use_reentrant is None or use_reentrant is False:
        return
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"{where}: use_reentrant must be None or False, {got(use_reentrant)}.")
    runs = ("ckptlib.checkpoint is" if where == "checkpoint"
            else f"{where} runs ckptlib.checkpoint, which is")
    raise ValueError(f"{runs} always non-reentrant; drop use_reentrant=True (or use {instead}).")
