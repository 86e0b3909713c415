"""ckptlib.models: seeded demo models whose checkpointing switch never changes the numbers."""

from __future__ import annotations


import pytest
import torch

from ckptlib.models import CHECKPOINTING_MODES, MLPChain, TinyTransformer
from ckptlib.schedules import recursive, revolve, sqrt_n
from tests._grads import assert_bitwise_equal


def small_mlp(**kwargs) -> MLPChain:
    return MLPChain(depth=6, width=16, **kwargs)


def small_transformer(**kwargs) -> TinyTransformer:
    return TinyTransformer(depth=4, d_model=32, heads=4, seq=16, vocab=40, **kwargs)


def loss_and_grads(model, checkpointing, batch, rng_seed: int = 0):
    model.checkpointing = checkpointing
    torch.manual_seed(rng_seed)  # dropout draws from the global RNG
    loss = model.training_step(batch)
    return loss, [p.grad.clone() for p in model.parameters()]


PLANS = {
    "sqrt_n": lambda n: sqrt_n(n),
    "revolve": lambda n: revolve(n, 2),
    "recursive": lambda n: recursive(n),
}


@pytest.mark.parametrize(
    "make", [small_mlp, lambda: small_transformer(dropout=0.2)], ids=["mlp", "transformer"]
)
@pytest.mark.parametrize("mode", ["block", "torch", "sqrt", "selective", *PLANS])
def test_every_checkpointing_mode_gives_bitwise_equal_gradients(make, mode):
    model = make()
    batch = model.example_batch(batch=4)
    loss, grads = loss_and_grads(model, "none", batch)
    checkpointing = PLANS[mode](len(model.blocks)) if mode in PLANS else mode
    loss_ckpt, grads_ckpt = loss_and_grads(model, checkpointing, batch)
    assert loss == loss_ckpt
    for (name, _), plain, checkpointed in zip(model.named_parameters(), grads, grads_ckpt):
        assert torch.equal(plain, checkpointed), (
            f"gradient of {name} differs under checkpointing={mode!r}"
        )


def test_dropout_is_active_in_training_so_the_equality_above_means_something():
    model = small_transformer(dropout=0.2)
    batch = model.example_batch(batch=4)
    first, _ = loss_and_grads(model, "none", batch, rng_seed=0)
    other, _ = loss_and_grads(model, "none", batch, rng_seed=1)
    model.eval()
    evaluated = [model.loss(batch).item() for _ in range(2)]
    assert first != other and evaluated[0] == evaluated[1]


def test_training_step_resets_gradients_instead_of_accumulating():
    model = small_mlp()
    batch = model.example_batch(batch=4)
    _, once = loss_and_grads(model, "none", batch)
    _, again = loss_and_grads(model, "none", batch)
    assert_bitwise_equal(again, once)


@pytest.mark.parametrize("make", [small_mlp, small_transformer], ids=["mlp", "transformer"])
def test_parameters_are_a_function_of_the_seed_and_leave_the_global_rng_alone(make):
    rng_before = torch.get_rng_state()
    first, second, other = make(seed=3), make(seed=3), make(seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before)
    pairs = list(zip(first.parameters(), second.parameters(), other.parameters()))
    assert all(torch.equal(a, b) for a, b, _ in pairs)
    assert not all(torch.equal(a, c) for a, _, c in pairs)


def test_example_batches_are_seeded_and_shaped():
    mlp = small_mlp()
    x, target = mlp.example_batch(batch=5, seed=1)
    assert x.shape == target.shape == (5, 16)
    assert torch.equal(x, mlp.example_batch(batch=5, seed=1)[0])
    assert not torch.equal(x, mlp.example_batch(batch=5, seed=2)[0])

    model = small_transformer()
    tokens, targets = model.example_batch(batch=3)
    assert tokens.shape == targets.shape == (3, 16) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # targets are the next tokens
    assert int(tokens.max()) < 40


def test_attention_is_causal():
    model = small_transformer().eval()
    tokens, _ = model.example_batch(batch=2)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 40
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :-1], after[:, :-1])
    assert not torch.equal(before[:, -1], after[:, -1])


def test_shorter_sequences_work_and_longer_ones_are_refused():
    model = small_transformer()
    tokens, _ = model.example_batch(batch=2)
    assert model(tokens[:, :5]).shape == (2, 5, 40)
    with pytest.raises(ValueError, match="at most 16 tokens, got 17"):
        model(torch.zeros(2, 17, dtype=torch.int64))


def test_blocks_are_a_sequential_for_checkpoint_sequential():
    assert isinstance(small_mlp().blocks, torch.nn.Sequential) and len(small_mlp().blocks) == 6
    assert isinstance(small_transformer().blocks, torch.nn.Sequential)


@pytest.mark.parametrize("bad", ["all", "Block", None, 3])
def test_bad_checkpointing_values_list_the_valid_ones(bad):
    with pytest.raises(ValueError, match="'none', 'block', 'torch', 'sqrt'"):
        small_mlp(checkpointing=bad)
    model = small_transformer()
    with pytest.raises(ValueError, match="ckptlib.schedules.Plan"):
        model.checkpointing = bad
    assert model.checkpointing == "none"
    assert CHECKPOINTING_MODES == ("none", "block", "torch", "sqrt", "selective")


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="depth must be an integer >= 1, got 0"):
        MLPChain(depth=0, width=8)
    with pytest.raises(ValueError, match="divisible by heads"):
        TinyTransformer(d_model=30, heads=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["none", "block", "torch", "sqrt"])
def test_models_train_on_cuda(mode):
    for model in (
        small_mlp(checkpointing=mode).cuda(),
        small_transformer(checkpointing=mode).cuda(),
    ):
        batch = model.example_batch(batch=4)
        assert batch[0].is_cuda
        assert model.training_step(batch) > 0
        assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
