"""Hugging Face models for the tests: GPT-2 and Llama built from small ``transformers`` configs,
random weights, nothing downloaded.

A test that needs one is skipped where the hf extra is not installed. Each test names the sizes
it depends on; the defaults here are the ones every test shares. A model is returned in the mode
it is built in: the test says ``.train()`` or ``.eval()``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

HF_EXTRA = "the hf extra: pip install -e '.[hf]'"


def hf_transformers():
    """``transformers``, or a skip where the hf extra is not installed."""
    transformers = pytest.importorskip("transformers", reason=HF_EXTRA)
    # config notes about random-weight models, not ours to test
    transformers.logging.set_verbosity_error()
    return transformers


def hf_gpt2(
    *, n_layer: int, n_embd: int = 64, n_head: int = 4, vocab_size: int = 128, **config
) -> nn.Module:
    """``GPT2LMHeadModel`` with weights drawn after ``torch.manual_seed(0)``; ``config`` is the
    rest of its ``GPT2Config`` (``n_positions``, token ids)."""
    transformers = hf_transformers()
    torch.manual_seed(0)
    sizes = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**sizes, **config))


def hf_llama(
    *,
    num_hidden_layers: int,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 128,
    **config,
) -> nn.Module:
    """``LlamaForCausalLM`` with weights drawn after ``torch.manual_seed(0)``; ``config`` is the
    rest of its ``LlamaConfig`` (``max_position_embeddings``, token ids)."""
    transformers = hf_transformers()
    torch.manual_seed(0)
    sizes = dict(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
    )
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, **config))
