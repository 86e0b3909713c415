"""Misuse of ckptlib.models: each bad argument is a TypeError or ValueError at the call, naming it.

Before these checks: ``TinyTransformer(depth=0)`` built a model with no blocks, ``heads=0``
divided by zero, ``MLPChain(width="8")`` failed comparing str with int and ``depth=True`` built
one layer; ``training_step(x)`` with one tensor unpacked it into two rows and trained on them;
a float or 1-d ``tokens`` failed inside the embedding or with an IndexError.
"""
from __future__ import annotations

import pytest
import torch

from ckptlib.models import MLPChain, TinyTransformer
from tests._grads import assert_bitwise_equal
from tests._misuse import Misuse, assert_refused, assert_same_module_state, module_state, rows

MLP = MLPChain(depth=2, width=4)
GPT = TinyTransformer(depth=1, d_model=8, heads=2, seq=4, vocab=10)
X, TARGET = MLP.example_batch(batch=2)
TOKENS, _ = GPT.example_batch(batch=2)

TABLE = [
    Misuse(
        "MLPChain(width='8')",
        lambda: MLPChain(width="8"),
        TypeError,
        ("MLPChain: width must be an integer >= 1", "'8' (str)"),
    ),
    Misuse(
        "MLPChain(depth=True)",
        lambda: MLPChain(depth=True, width=4),
        TypeError,
        ("depth must be an integer >= 1", "True (bool)"),
    ),
    Misuse(
        "MLPChain(depth=2.5)",
        lambda: MLPChain(depth=2.5, width=4),
        TypeError,
        ("MLPChain: depth", "2.5 (float)"),
    ),
    Misuse(
        "MLPChain(seed='0')",
        lambda: MLPChain(depth=1, width=4, seed="0"),
        TypeError,
        ("MLPChain: seed must be an integer", "'0' (str)"),
    ),
    Misuse(
        "MLPChain(seed=None)",
        lambda: MLPChain(depth=1, width=4, seed=None),
        TypeError,
        ("seed must be an integer", "got None"),
    ),
    Misuse(
        "TinyTransformer(depth=0)",
        lambda: TinyTransformer(depth=0),
        ValueError,
        ("TinyTransformer: depth must be an integer >= 1", "got 0"),
    ),
    Misuse(
        "TinyTransformer(heads=0)",
        lambda: TinyTransformer(heads=0),
        ValueError,
        ("heads must be an integer >= 1", "got 0"),
    ),
    Misuse(
        "TinyTransformer(d_model='8')",
        lambda: TinyTransformer(d_model="8"),
        TypeError,
        ("d_model must be an integer", "'8' (str)"),
    ),
    Misuse(
        "TinyTransformer(seq=0)",
        lambda: TinyTransformer(seq=0),
        ValueError,
        ("seq must be an integer >= 1",),
    ),
    Misuse(
        "TinyTransformer(vocab=-1)",
        lambda: TinyTransformer(vocab=-1),
        ValueError,
        ("vocab must be an integer >= 1", "got -1"),
    ),
    Misuse(
        "TinyTransformer(dropout=1.5)",
        lambda: TinyTransformer(dropout=1.5),
        ValueError,
        ("dropout must be a finite probability between 0 and 1", "1.5"),
    ),
    Misuse(
        "TinyTransformer(dropout=nan)",
        lambda: TinyTransformer(dropout=float("nan")),
        ValueError,
        ("dropout", "got nan"),
    ),
    Misuse(
        "TinyTransformer(dropout='0.1')",
        lambda: TinyTransformer(dropout="0.1"),
        TypeError,
        ("dropout", "'0.1' (str)"),
    ),
    Misuse(
        "example_batch(batch=0)",
        lambda: MLP.example_batch(batch=0),
        ValueError,
        ("MLPChain.example_batch: batch must be an integer >= 1", "got 0"),
    ),
    Misuse(
        "example_batch(batch=2.0)",
        lambda: GPT.example_batch(batch=2.0),
        TypeError,
        ("TinyTransformer.example_batch: batch", "2.0 (float)"),
    ),
    Misuse(
        "example_batch(seed=None)",
        lambda: MLP.example_batch(seed=None),
        TypeError,
        ("example_batch: seed must be an integer", "got None"),
    ),
    Misuse(
        "training_step(one tensor)",
        lambda: MLP.training_step(X),
        TypeError,
        (
            "MLPChain.training_step: batch must be an (input, target) pair",
            "got a Tensor of shape (2, 4)",
        ),
    ),
    Misuse(
        "training_step((x,))",
        lambda: MLP.training_step((X,)),
        TypeError,
        ("batch must be an (input, target) pair",),
    ),
    Misuse(
        "loss(one tensor)",
        lambda: GPT.loss(TOKENS),
        TypeError,
        ("TinyTransformer.loss: batch must be an (input, target) pair",),
    ),
    Misuse(
        "MLPChain forward, wrong width",
        lambda: MLP(torch.zeros(2, 3)),
        ValueError,
        ("MLPChain(width=4): x must have shape (batch, 4)", "got shape (2, 3)"),
    ),
    Misuse(
        "MLPChain forward, not a tensor",
        lambda: MLP([[0.0] * 4]),
        TypeError,
        ("MLPChain: x must be a tensor", "(list)"),
    ),
    Misuse(
        "TinyTransformer forward, float tokens",
        lambda: GPT(TOKENS.float()),
        TypeError,
        ("tokens must be a tensor of integer token ids", "dtype torch.float32"),
    ),
    Misuse(
        "TinyTransformer forward, 1-d tokens",
        lambda: GPT(TOKENS[0]),
        ValueError,
        ("tokens must have shape (batch, seq)", "got shape (4,)", "unsqueeze(0)"),
    ),
]


@pytest.mark.parametrize("row", rows(TABLE))
def test_misuse_is_refused_at_the_call(row):
    MLP.training_step((X, TARGET))  # gradients to keep: a refused step must not reset them
    GPT.training_step()
    before = [module_state(MLP), module_state(GPT)]
    assert_refused(row)                        # also: the global RNG is untouched
    for model, state in zip((MLP, GPT), before):
        assert_same_module_state(state, module_state(model))


def test_a_refused_step_leaves_the_last_gradients_alone():
    """Before: training_step(x) ran, resetting the gradients and training on x's two rows."""
    MLP.training_step((X, TARGET))
    gradients = [p.grad.clone() for p in MLP.parameters()]
    with pytest.raises(TypeError):
        MLP.training_step(X)
    assert_bitwise_equal([p.grad for p in MLP.parameters()], gradients)
