"""Predict, then measure: how close a learner's guess came to what the next cell measured.

The course asks for a guess before a cell measures something (cells tagged ``predict``). The
guess is a plain variable in the ``predict`` cell, so the notebook also runs top to bottom
(under nbval, on the static site) with the guess it was committed with; the cell after it
measures and calls :func:`check_prediction`, whose answer is one readable sentence.

A number is judged by its relative error (within ``tolerance`` counts as right); anything else
(a string, a bool, an op name, a choice among options) must be equal.

>>> check_prediction(3, 4, what="saved tensors")
Your guess for saved tensors: 3. Measured: 4. Off by 1 (25% low).
>>> check_prediction("exp", "exp", what="the op that saves its output")
Your guess for the op that saves its output: 'exp'. Measured: 'exp'. Right.
>>> check_prediction(None, 4, what="saved tensors")
No guess yet for saved tensors: set it in the cell above, run that cell, then this one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any

__all__ = ["check_prediction", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one prediction; ``repr`` (what a notebook shows) is one sentence."""

    guess: Any
    measured: Any
    what: str
    unit: str
    right: bool
    relative_error: float | None  # (guess - measured) / |measured| for numbers, else None

    @property
    def attempted(self) -> bool:
        return self.guess is not None and self.guess is not Ellipsis

    def __repr__(self) -> str:
        if not self.attempted:
            return f"No guess yet for {self.what}: set it in the cell above, run that cell, then this one."
        unit = f" {self.unit}" if self.unit else ""
        if self.relative_error is None:
            head = f"Your guess for {self.what}: {self.guess!r}. Measured: {self.measured!r}."
            return head + (" Right." if self.right else " Not this time: read the measurement, then the text below.")
        head = f"Your guess for {self.what}: {_number(self.guess)}{unit}. Measured: {_number(self.measured)}{unit}."
        if self.guess == self.measured:
            return head + " Exactly right."
        error = self.guess - self.measured
        if self.measured == 0:
            return head + f" Off by {_number(abs(error))}{unit}."
        side = "high" if error > 0 else "low"
        verdict = f" Off by {_number(abs(error))}{unit} ({abs(self.relative_error):.0%} {side})."
        return head + verdict + (" Close enough." if self.right else "")


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _number(value: Real) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.3g}"
    return f"{int(value):,}"


def check_prediction(guess: Any, measured: Any, *, what: str, unit: str = "",
                     tolerance: float = 0.0) -> Verdict:
    """Compare a learner's ``guess`` with the ``measured`` value and say how close it was.

    Args:
        guess: the value the learner set in the ``predict`` cell; ``None`` or ``...`` means
            "not guessed yet".
        measured: what the cell measured (a number, string, bool, ...).
        what: what was guessed, in a few words ("saved tensors", "bytes freed").
        unit: a unit to print after numbers ("B", "x").
        tolerance: for numbers, the relative error still counted as right (0.1 = within 10%).
    """
    if not isinstance(what, str) or not what:
        raise TypeError(f"check_prediction: what must be a non-empty string naming the quantity, got {what!r}")
    if not isinstance(unit, str):
        raise TypeError(f"check_prediction: unit must be a string such as 'B', got {unit!r}")
    if not _is_number(tolerance) or not 0 <= tolerance < 1 or math.isnan(tolerance):
        raise ValueError(f"check_prediction: tolerance must be a number in [0, 1), got {tolerance!r}")
    if guess is None or guess is Ellipsis:
        return Verdict(guess, measured, what, unit, False, None)
    if _is_number(guess) and _is_number(measured):
        relative = (guess - measured) / abs(measured) if measured else (0.0 if guess == measured else math.inf)
        return Verdict(guess, measured, what, unit, abs(relative) <= tolerance, relative)
    return Verdict(guess, measured, what, unit, guess == measured, None)
