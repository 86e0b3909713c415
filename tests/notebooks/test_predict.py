"""ckptlib.predict: the sentence a learner reads after a prediction."""
import math

import pytest

from ckptlib.predict import NO_GUESS, check_prediction


@pytest.mark.parametrize("guess, measured, tolerance, right, text", [
    (4, 4, 0.0, True, "Exactly right."),
    (3, 4, 0.0, False, "Off by 1 B (25% low)."),
    (5, 4, 0.3, True, "Off by 1 B (25% high). Close enough."),
    (20480, 49152, 0.1, False, "Measured: 49,152 B. Off by 28,672 B (58% low)."),
    (1.5, 1.33, 0.2, True, "Your guess for x: 1.5 B. Measured: 1.33 B."),
    (2, 0, 0.5, False, "Off by 2 B."),
])
def test_numbers_are_judged_by_relative_error(guess, measured, tolerance, right, text):
    verdict = check_prediction(guess, measured, what="x", unit="B", tolerance=tolerance)
    assert verdict.right is right
    assert text in repr(verdict)


def test_choices_must_be_equal():
    assert check_prediction("exp", "exp", what="op").right
    wrong = check_prediction(True, False, what="match")
    assert not wrong.right and "Not this time" in repr(wrong)
    assert (
        check_prediction(True, True, what="flag").relative_error is None
    )  # a bool is a choice, not a number


@pytest.mark.parametrize(
    "guess, measured",
    [
        (NO_GUESS, 3),
        (NO_GUESS, None),
        (NO_GUESS, "SinBackward0"),
        (NO_GUESS, False),
        (..., 3),
        (..., None),
        (None, 3),
        (None, 2.5),
    ],
)  # None for a number: not guessed
def test_no_guess_yet(guess, measured):
    verdict = check_prediction(guess, measured, what="saved tensors")
    assert not verdict.attempted and not verdict.right
    assert repr(verdict).startswith("No guess yet for saved tensors")


def test_none_is_an_answer_where_the_measurement_is_not_a_number():
    """Notebook 01: the grad_fn of a tensor that needs no gradient is None, the right answer."""
    right = check_prediction(None, None, what="the article's grad_fn")
    assert right.attempted and right.right
    assert repr(right) == "Your guess for the article's grad_fn: None. Measured: None. Right."
    wrong = check_prediction(None, "SinBackward0", what="the grad_fn")
    assert wrong.attempted and not wrong.right and "Not this time" in repr(wrong)
    assert not check_prediction("SinBackward0", None, what="the grad_fn").right
    assert not check_prediction(
        None, False, what="a flag"
    ).right  # a bool is a choice, None a wrong one


def test_no_guess_is_never_a_measurement():
    assert repr(NO_GUESS) == "NO_GUESS"
    with pytest.raises(TypeError, match="measured is NO_GUESS"):
        check_prediction(3, NO_GUESS, what="x")


@pytest.mark.parametrize("kwargs, error, words", [
    ({"what": ""}, TypeError, "what"),
    ({"what": "x", "unit": 3}, TypeError, "unit"),
    ({"what": "x", "tolerance": 1.5}, ValueError, "tolerance"),
    ({"what": "x", "tolerance": math.nan}, ValueError, "tolerance"),
    ({"what": "x", "tolerance": "10%"}, ValueError, "tolerance"),
])
def test_bad_arguments_say_which(kwargs, error, words):
    with pytest.raises(error, match=words):
        check_prediction(1, 2, **kwargs)
