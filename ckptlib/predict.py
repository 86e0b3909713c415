"""Predict, then measure: how close a learner's guess came to what the next cell measured.

The course asks for a guess before a cell measures something (cells tagged ``predict``). The
guess is a plain variable in the ``predict`` cell, so the notebook also runs top to bottom
(under nbval, on the static site) with the guess it was committed with; the cell after it
measures and calls :func:`check_prediction`, whose answer is one readable sentence.

A number is judged by its relative error (within ``tolerance`` counts as right); anything else
(a string, a bool, an op name, ``None``, a choice among options) must be equal.

"Not guessed yet" is :data:`NO_GUESS`, a marker that no answer can be: ``None`` is a real
answer where a node may not exist (notebook 01 asks for the ``grad_fn`` of a tensor that has
none). ``...`` means not guessed yet too, and so does ``None`` where the answer is a number
(no count or size is ``None``), as in cells written before ``NO_GUESS`` existed.

>>> check_prediction(3, 4, what="saved tensors")
Your guess for saved tensors: 3. Measured: 4. Off by 1 (25% low).
>>> check_prediction("exp", "exp", what="the op that saves its output")
Your guess for the op that saves its output: 'exp'. Measured: 'exp'. Right.
>>> check_prediction(None, None, what="the grad_fn")
Your guess for the grad_fn: None. Measured: None. Right.
>>> check_prediction(NO_GUESS, 4, what="saved tensors")
No guess yet for saved tensors: set it in the cell above, run that cell, then this one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any

__all__ = ["NO_GUESS", "check_prediction", "Verdict"]


class _NoGuess:
    """The type of :data:`NO_GUESS`: a marker equal only to itself, so never a measurement."""

    def __repr__(self) -> str:
        return "NO_GUESS"


NO_GUESS = _NoGuess()
"""The value of a guess not made yet: ``guess_peak = NO_GUESS``. No measurement is ever equal
to it."""


def _not_guessed(guess: Any, measured: Any) -> bool:
    """Whether ``guess`` says "not guessed yet" rather than giving an answer."""
    if guess is NO_GUESS or guess is Ellipsis:
        return True
    return guess is None and _is_number(measured)     # older cells: None for a number not guessed


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
        return not _not_guessed(self.guess, self.measured)

    def __repr__(self) -> str:
        if not self.attempted:
            return (f"No guess yet for {self.what}: set it in the cell above, run that cell, "
                    "then this one.")
        unit = f" {self.unit}" if self.unit else ""
        if self.relative_error is None:
            head = f"Your guess for {self.what}: {self.guess!r}. Measured: {self.measured!r}."
            return head + (" Right." if self.right
                           else " Not this time: read the measurement, then the text below.")
        head = (f"Your guess for {self.what}: {_number(self.guess)}{unit}. "
                f"Measured: {_number(self.measured)}{unit}.")
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
        guess: the value the learner set in the ``predict`` cell; :data:`NO_GUESS` (or ``...``)
            means "not guessed yet", and so does ``None`` when ``measured`` is a number.
            Otherwise ``None`` is an answer, compared with ``measured`` like any other.
        measured: what the cell measured (a number, string, bool, ...).
        what: what was guessed, in a few words ("saved tensors", "bytes freed").
        unit: a unit to print after numbers ("B", "x").
        tolerance: for numbers, the relative error still counted as right (0.1 = within 10%).
    """
    if not isinstance(what, str) or not what:
        raise TypeError("check_prediction: what must be a non-empty string naming the quantity, "
                        f"got {what!r}")
    if not isinstance(unit, str):
        raise TypeError(f"check_prediction: unit must be a string such as 'B', got {unit!r}")
    if not _is_number(tolerance) or not 0 <= tolerance < 1 or math.isnan(tolerance):
        raise ValueError(
            f"check_prediction: tolerance must be a number in [0, 1), got {tolerance!r}")
    if measured is NO_GUESS:
        raise TypeError(f"check_prediction: measured is NO_GUESS for {what!r}; "
                        "pass what the cell measured")
    if _not_guessed(guess, measured):
        return Verdict(guess, measured, what, unit, False, None)
    if _is_number(guess) and _is_number(measured):
        relative = ((guess - measured) / abs(measured) if measured
                    else (0.0 if guess == measured else math.inf))
        return Verdict(guess, measured, what, unit, abs(relative) <= tolerance, relative)
    return Verdict(guess, measured, what, unit, guess == measured, None)
