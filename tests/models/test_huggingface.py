"""ckptlib on Hugging Face models (GPT-2 and Llama built from small configs, random weights):
bitwise against no checkpointing and against HF's own switch, keys, masks, the cache, and
every snippet of docs/huggingface.md."""
from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib import CheckpointError, apply_checkpointing, record_trace, remove_checkpointing
from tests._grads import assert_same_step, seeded_step
from tests._misuse import assert_nothing_installed
from tests._models import hf_gpt2, hf_llama, hf_transformers
from tests.models.test_apply import kept_after_forward

hf_transformers()  # the whole file is skipped without the hf extra

DOCS = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
VOCAB = 128


def gpt2() -> torch.nn.Module:
    return hf_gpt2(
        n_layer=4, n_positions=64, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
    ).train()


def llama() -> torch.nn.Module:
    return hf_llama(
        num_hidden_layers=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    ).train()


MODELS = {"gpt2": (gpt2, "transformer.h"), "llama": (llama, "model.layers")}

INPUT_IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
PADDED = torch.ones(2, 16, dtype=torch.long)
PADDED[1, :5] = 0


def step(model, attention_mask=PADDED, **kwargs):
    """One training step with the same dropout masks every time (GPT-2's dropout is on)."""
    return seeded_step(
        model,
        lambda: model(
            input_ids=INPUT_IDS,
            attention_mask=attention_mask,
            labels=INPUT_IDS,
            use_cache=False,
            **kwargs,
        ).loss,
    )


@pytest.fixture(params=list(MODELS))
def model_and_layers(request):
    make, layers = MODELS[request.param]
    return make(), layers


def test_apply_checkpointing_is_bitwise_plain_autograd_and_hfs_switch_with_padding(
    model_and_layers,
):
    model, layers = model_and_layers
    plain = step(model)
    assert not torch.equal(
        step(model, attention_mask=None)[0], plain[0]
    )  # the padding mask matters
    keys = list(model.state_dict())
    with apply_checkpointing(model) as handle:
        assert handle.paths == [f"{layers}.{i}" for i in range(4)]
        assert list(model.state_dict()) == keys
        with record_trace() as trace:
            assert_same_step(plain, step(model))
        assert trace.count("recompute") == 4
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert_same_step(plain, step(model))
    model.activation_checkpointing_disable()
    assert_nothing_installed()


def test_every_n_matches_hfs_every_n_layers(model_and_layers):
    model, layers = model_and_layers
    model.activation_checkpointing_enable(every_n_layers=2)
    hf_chosen = [
        path
        for path, module in model.named_modules()
        if getattr(module, "gradient_checkpointing", False) and path.startswith(layers + ".")
    ]
    hf = step(model)
    model.activation_checkpointing_disable()
    with apply_checkpointing(model, every_n=2) as handle:
        assert handle.paths == hf_chosen == [f"{layers}.0", f"{layers}.2"]
        assert_same_step(hf, step(model))


@pytest.mark.parametrize("how", ["offload", ckptlib.save_matmuls], ids=["offload", "save_matmuls"])
def test_offload_and_selective_are_bitwise_too(how):
    model = llama()
    plain = step(model)
    with apply_checkpointing(model, how=how):
        assert_same_step(plain, step(model))


def test_remove_restores_the_models_own_forward_and_outputs():
    model = gpt2().eval()
    with torch.no_grad():
        before = model(input_ids=INPUT_IDS).logits
    apply_checkpointing(model, "transformer.h.*")
    assert remove_checkpointing(model) == [f"transformer.h.{i}" for i in range(4)]
    assert not any("forward" in vars(module) for module in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=INPUT_IDS).logits, before)


def test_the_cache_is_left_out_of_checkpointed_calls_with_one_warning_and_kept_without_gradients():
    model = gpt2()
    plain = step(model)
    with apply_checkpointing(model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(1234)
                loss = model(
                    input_ids=INPUT_IDS, attention_mask=PADDED, labels=INPUT_IDS, use_cache=True
                ).loss
                loss.backward()
        messages = [str(w.message) for w in caught if "apply_checkpointing" in str(w.message)]
        assert (
            len(messages) == 1
            and "use_cache=False" in messages[0]
            and "DynamicCache" in messages[0]
        )
        assert torch.equal(loss.detach(), plain[0])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(model)                                      # use_cache=False: nothing to say
            with torch.no_grad():                            # generation: the layers fill the cache
                cache = model(input_ids=INPUT_IDS, use_cache=True).cache
        assert cache.get_seq_length() == INPUT_IDS.shape[1]


def test_errors_name_the_layer_by_module_path():
    model = gpt2()
    with apply_checkpointing(model):
        loss = model(input_ids=INPUT_IDS, labels=INPUT_IDS, use_cache=False).loss
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight.add_(1.0)
        with pytest.raises(
            CheckpointError, match=r"checkpoint transformer\.h\.1@\d+: .*modified in place"
        ):
            loss.backward()
    assert_nothing_installed()


def test_hfs_switch_and_apply_checkpointing_together_are_refused_either_way_round():
    model = gpt2()
    model.activation_checkpointing_enable()
    with pytest.raises(
        CheckpointError,
        match=r"transformer\.h\.0: Hugging Face's gradient checkpointing is on .*"
        r"gradient_checkpointing_disable\(\)",
    ):
        apply_checkpointing(model)
    assert not any("forward" in vars(module) for module in model.modules())
    model.activation_checkpointing_disable()
    apply_checkpointing(model)
    model.activation_checkpointing_enable()
    with pytest.raises(CheckpointError, match="checkpointed twice"):
        step(model)
    remove_checkpointing(model)


def test_every_snippet_of_the_hugging_face_page_runs_and_checkpoints_with_ckptlib(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)              # Trainer's output_dir
    text = DOCS.read_text()
    assert "_set_gradient_checkpointing" not in text   # public APIs only
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 7
    namespace: dict = {}
    regions = []
    for number, block in enumerate(blocks):
        with record_trace() as trace:
            exec(compile(block, f"docs/huggingface.md block {number}", "exec"), namespace)
        regions.append({event.region.name for event in trace.events})
    model = namespace["hf_model"]
    assert regions[1] == {f"transformer.h.{i}" for i in range(4)}  # apply_checkpointing
    assert regions[2] == {"transformer.h.0", "transformer.h.2"}  # every_n=2, as a context manager
    assert regions[3] == set() and regions[4] == set()  # HF's switch: torch.utils.checkpoint
    assert regions[5] == {
        f"transformer.h.{i}" for i in range(4)
    }  # Trainer after apply_checkpointing
    plan = namespace["plan"]
    assert plan.module_paths() and regions[6] >= set(plan.module_paths())  # the callback's plan
    assert not any("forward" in vars(module) for module in model.modules())


def test_the_switch_with_a_ckptlib_policy_in_torchs_selective_checkpoint_is_bitwise():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    model = gpt2()
    plain = step(model)
    keep_matmuls = functools.partial(
        create_selective_checkpoint_contexts, list(ckptlib.save_matmuls)
    )
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": keep_matmuls}
    )
    try:
        assert_same_step(plain, step(model))
    finally:
        model.activation_checkpointing_disable()


def test_trainers_activation_checkpointing_with_ckptlib_names_the_flag(tmp_path, monkeypatch):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    monkeypatch.chdir(tmp_path)
    model = gpt2()

    class Apply(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            apply_checkpointing(model)

    rows = [{"input_ids": INPUT_IDS[0], "labels": INPUT_IDS[0]}] * 2
    args = TrainingArguments("build/trainer", max_steps=1, per_device_train_batch_size=2,
                             report_to="none", save_strategy="no", use_cpu=True,
                             activation_checkpointing=True)
    with pytest.raises(CheckpointError, match=r"activation_checkpointing_disable\(\).*"
                       r"TrainingArguments\(activation_checkpointing=True\).*leave it False"):
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[Apply()]).train()
    assert remove_checkpointing(model) == []   # refused before anything was wrapped
    model.activation_checkpointing_disable()


def test_the_readmes_three_lines_run_on_a_hugging_face_model():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Use it on your model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    model = gpt2()
    batch = {"input_ids": INPUT_IDS, "attention_mask": PADDED, "labels": INPUT_IDS}
    torch.manual_seed(1234)
    expected = model(**batch, use_cache=False).loss
    torch.manual_seed(1234)
    with record_trace() as trace:
        exec(compile(code, "README.md", "exec"), {"model": model, "batch": batch})
    assert trace.count("recompute") == 4
    assert not any("forward" in vars(module) for module in model.modules())
    assert "use_cache=False" in code   # no key/value cache in training
    torch.manual_seed(1234)
    assert torch.equal(model(**batch, use_cache=False).loss, expected)


def test_plan_checkpointing_on_llama_is_the_same_twice_predicts_what_is_kept_and_trains_bitwise():
    inputs = {
        "input_ids": INPUT_IDS,
        "attention_mask": PADDED,
        "labels": INPUT_IDS,
        "use_cache": False,
    }
    everything = ckptlib.plan_checkpointing(llama(), inputs, budget_bytes=10**12)
    plans = [
        ckptlib.plan_checkpointing(llama(), inputs, budget_bytes=everything.saved_bytes * 7 // 10)
        for _ in range(2)
    ]
    assert plans[0] == plans[1] and plans[0].checkpointed
    model = llama()
    plain = step(model)
    with apply_checkpointing(model, plans[0]):
        assert (
            kept_after_forward(model, **inputs) == plans[0].kept_bytes <= plans[0].budget_bytes
        )  # mask too
        assert_same_step(plain, step(model))


def test_checkpoint_sequential_and_the_cost_measurement_take_the_layers_keyword_arguments():
    from ckptlib.schedules import plan_for_budget, revolve
    from ckptlib.sequential import checkpoint_sequential, measure_layer_costs

    model = llama()
    seen = {}
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(hidden=args[0].detach(), kwargs=kwargs),
        with_kwargs=True,
    )
    model(input_ids=INPUT_IDS, attention_mask=PADDED, use_cache=False)
    handle.remove()
    kwargs = {name: value for name, value in seen["kwargs"].items() if name != "cache"}
    assert {"attention_mask", "position_embeddings"} <= kwargs.keys()
    layers = model.model.layers

    def gradients(run):
        hidden = seen["hidden"].clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        output = run(hidden)
        output.square().sum().backward()
        return output.detach(), [hidden.grad, *(p.grad for p in layers.parameters())]

    def plain(hidden, **extra):
        for layer in layers:
            hidden = layer(hidden, **{**kwargs, **extra})
        return hidden

    expected = gradients(plain)
    assert not torch.equal(
        gradients(lambda h: plain(h, attention_mask=None))[0], expected[0]
    )  # the mask matters
    for plan in (2, revolve(4, 2)):
        got = gradients(lambda h: checkpoint_sequential(layers, plan, h, layer_kwargs=kwargs))
        assert torch.equal(got[0], expected[0]) and all(map(torch.equal, got[1], expected[1]))
    costs = measure_layer_costs(layers, seen["hidden"], layer_kwargs=kwargs, repeat=1)
    assert len(costs) == 4 and all(cost.saved_bytes > cost.input_bytes > 0 for cost in costs)
    assert plan_for_budget(costs, sum(cost.saved_bytes for cost in costs) // 2).forward_steps > 0


def test_selective_plans_are_reused_through_hfs_partials_bitwise():
    from ckptlib.selective import SelectivePlans, selective_checkpoint

    model = gpt2()                # dropout on: the reused plans replay its masks too
    plain = step(model)
    plans = SelectivePlans()
    function = functools.partial(selective_checkpoint, policy=ckptlib.save_matmuls, plans=plans)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)
    for _ in range(3):
        got = step(model)
    model.activation_checkpointing_disable()
    assert (len(plans), plans.recorded, plans.reused, plans.fallbacks) == (
        4,
        4,
        8,
        0,
    )  # one plan per layer
    assert_same_step(plain, got)


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_no_policy_holds_more_than_plain_autograd(make):
    model = make().eval()         # no dropout: the same ops every step
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))

    def training_step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    def kept_after_forward_bytes() -> int:      # in train mode, dropout on: what waits for backward
        model.train()
        torch.manual_seed(0)
        with ckptlib.MemoryMeter("cpu", backend="tensors", timeline=False) as meter:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            kept = meter.live_bytes
        del loss
        model.eval()
        return kept

    plain, plain_kept = ckptlib.measure(training_step).peak_bytes, kept_after_forward_bytes()
    for policy in (ckptlib.save_matmuls, ckptlib.megatron_attention):
        with apply_checkpointing(model, how=policy):
            peak, kept = ckptlib.measure(training_step).peak_bytes, kept_after_forward_bytes()
        assert peak <= plain, f"{policy}: peak {peak} > plain autograd's {plain}"
        assert kept <= plain_kept, (
            f"{policy}: keeps {kept} for backward > plain autograd's {plain_kept}"
        )
