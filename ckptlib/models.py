"""Small demo models for the course: an MLP chain and a tiny GPT-style Transformer.

Both models keep their repeated part in ``.blocks`` (an ``nn.Sequential``) and
share one switch, ``checkpointing``, that decides how the blocks are run:

==========  ================================================================
``"none"``  plain autograd: every block keeps its activations
``"block"`` ``ckptlib.checkpoint`` around each block
``"torch"`` ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``
            around each block (the reference ckptlib is compared with)
``"sqrt"``  ``ckptlib.sequential.checkpoint_sequential`` with the
            ``ckptlib.schedules.sqrt_n`` plan for the n blocks
``"selective"`` ``ckptlib.selective.selective_checkpoint`` around each block with the
            ``save_matmuls`` policy: matmul outputs are kept, the rest recomputed
a ``Plan``  ``checkpoint_sequential`` with that ``ckptlib.schedules.Plan``
==========  ================================================================

The modes are those of the schedule registry (``ckptlib.schedules.registry``): a schedule
registered there with a ``mode`` is one more value of the switch.

The switch is an attribute, so one model can be measured every way:
``model.checkpointing = "block"``. Parameters are a pure function of ``seed``
(the global RNG is left as it was), and each model makes its own synthetic
batch, so a whole training step is one line::

    model = TinyTransformer()
    model.training_step(model.example_batch())

Sizes are chosen so that one default training step takes well under a second
on two CPU cores.
"""
from __future__ import annotations

import math
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ckptlib._arguments import got, integer, number
from ckptlib.schedules import Plan, registry
from ckptlib.sequential import checkpoint_sequential

# CHECKPOINTING_MODES: served by __getattr__ below, from the schedule registry
__all__ = ["MLPChain", "TinyTransformer", "CHECKPOINTING_MODES"]  # noqa: F822

Batch = tuple[torch.Tensor, torch.Tensor]
Checkpointing = Union[str, Plan]  # one of CHECKPOINTING_MODES, or a ckptlib.schedules.Plan


def __getattr__(name: str) -> object:
    # CHECKPOINTING_MODES is read from the schedule registry when asked for, so a schedule
    # registered later (ckptlib.schedules.registry.register) is a mode too.
    if name == "CHECKPOINTING_MODES":
        return registry.modes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _checked_mode(value: Checkpointing) -> Checkpointing:
    if isinstance(value, Plan) or (isinstance(value, str) and registry.by_mode(value) is not None):
        return value
    raise ValueError(
        f"checkpointing={value!r} is not a valid choice; use one of "
        f"{', '.join(repr(mode) for mode in registry.modes())}, "
        "or a ckptlib.schedules.Plan for checkpoint_sequential."
    )


def _checked_batch(batch: object, where: str) -> Batch:
    """``batch`` when it is an ``(input, target)`` pair of tensors. A bare tensor would unpack
    along its first dimension into two rows and train on nonsense, so it is refused too."""
    if (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        return tuple(batch)
    raise TypeError(f"{where}: batch must be an (input, target) pair of tensors, as "
                    f"example_batch() returns, {got(batch)}.")


def _checked_batch_size(batch: object, seed: object, where: str) -> tuple[int, int]:
    return integer(batch, "batch", least=1, where=where), integer(seed, "seed", where=where)


def run_blocks(blocks: nn.Sequential, x: torch.Tensor,
               checkpointing: Checkpointing) -> torch.Tensor:
    """Run ``x`` through ``blocks`` the way ``checkpointing`` says (see the module docstring):
    the mode's own ``run`` in the schedule registry, else ``checkpoint_sequential`` with its
    plan."""
    if isinstance(checkpointing, Plan):
        plan = checkpointing
    else:
        schedule = registry.by_mode(checkpointing)
        if schedule.run is not None:
            return schedule.run(blocks, x)
        plan = schedule.make(len(blocks))
    return checkpoint_sequential(blocks, plan, x)


class _DemoModel(nn.Module):
    """What both demo models share: the checkpointing switch and the one-line training step."""

    blocks: nn.Sequential

    def __init__(self, checkpointing: Checkpointing) -> None:
        super().__init__()
        self.checkpointing = checkpointing

    @property
    def checkpointing(self) -> Checkpointing:
        """How the blocks run: one of ``CHECKPOINTING_MODES`` (``"none"``, ``"block"``,
        ``"torch"``, ``"sqrt"``, ``"selective"``) or a ``Plan``."""
        return self._checkpointing

    @checkpointing.setter
    def checkpointing(self, value: Checkpointing) -> None:
        self._checkpointing = _checked_mode(value)

    @property
    def _name(self) -> str:
        return type(self).__name__

    @property
    def device(self) -> torch.device:
        """Where the parameters are, and so where ``example_batch`` puts its tensors."""
        return next(self.parameters()).device

    def loss(self, batch: Batch) -> torch.Tensor:
        """The scalar training loss on ``batch`` (defined by each model)."""
        raise NotImplementedError

    def training_step(self, batch: Batch | None = None) -> float:
        """Forward, loss and backward on ``batch`` (default: ``example_batch()``); returns the loss.

        Gradients are reset to ``None`` first, so every step allocates them afresh
        (what a memory meter around the step should see).
        """
        where = f"{self._name}.training_step"
        batch = self.example_batch() if batch is None else _checked_batch(batch, where)
        self.zero_grad(set_to_none=True)
        loss = self.loss(batch)
        loss.backward()
        return loss.item()

    def example_batch(self, batch: int = 8, seed: int = 0) -> Batch:
        """A seeded synthetic ``(input, target)`` pair (defined by each model)."""
        raise NotImplementedError


class MLPChain(_DemoModel):
    """``depth`` blocks of ``Linear(width, width)`` then ReLU, trained to regress a random target.

    ReLU is chosen because its memory is easy to count by hand: ReLU saves its
    *output*, which is also the input the next Linear saves, so each block keeps
    exactly one ``batch x width`` tensor for backward (the Linear's output dies as
    soon as ReLU has read it). With float32, the plain forward keeps
    ``4 * batch * width * depth`` bytes of activations; ``tests/memory/test_memory.py``
    derives the whole training step's peak.

    Two consequences worth a look. A checkpoint around each block saves nothing
    here: a block keeps only its input, which is what a checkpoint keeps anyway;
    ``"sqrt"`` or a ``Plan`` (several blocks per checkpoint) do shrink the chain.
    And activations only dominate when the batch is large next to the width: at
    the default sizes (batch 8, width 256) the gradients of the weights outweigh
    them, and no checkpointing lowers the step's peak.

    >>> model = MLPChain(depth=3, width=16)
    >>> x, target = model.example_batch(batch=4)
    >>> model(x).shape
    torch.Size([4, 16])
    >>> model.checkpointing = "block"      # same gradients (and here, as said, same memory)
    >>> model.training_step((x, target)) > 0
    True
    >>> model.checkpointing = "all"  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: checkpointing='all' is not a valid choice; use one of 'none', 'block', ...
    """

    def __init__(self, depth: int = 8, width: int = 256, *, checkpointing: Checkpointing = "none",
                 seed: int = 0) -> None:
        super().__init__(checkpointing)
        depth = integer(depth, "depth", least=1, where="MLPChain")
        width = integer(width, "width", least=1, where="MLPChain")
        seed = integer(seed, "seed", where="MLPChain")
        self.depth, self.width = depth, width
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                          for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MLPChain: x must be a tensor of shape (batch, {self.width}), "
                            f"{got(x)}.")
        if x.dim() == 0 or x.shape[-1] != self.width:
            raise ValueError(f"MLPChain(width={self.width}): x must have shape "
                             f"(batch, {self.width}), got shape {tuple(x.shape)}.")
        return run_blocks(self.blocks, x, self.checkpointing)

    def example_batch(self, batch: int = 8, seed: int = 0) -> Batch:
        """A random ``(input, target)`` pair, both ``batch x width``, on the model's device."""
        batch, seed = _checked_batch_size(batch, seed, "MLPChain.example_batch")
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, self.width, generator=generator)
        target = torch.randn(batch, self.width, generator=generator)
        return x.to(self.device), target.to(self.device)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, target = _checked_batch(batch, "MLPChain.loss")
        return F.mse_loss(self(x), target)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out op by op.

    The explicit ``softmax(q k^T / sqrt(d_head)) v`` makes autograd save the
    ``batch x heads x seq x seq`` attention matrix, the activation that makes
    attention memory-hungry and checkpointing worthwhile. A fused kernel
    (``F.scaled_dot_product_attention``) would save only a small summary on some
    devices and the full matrix on others, so what the course measures would
    depend on the learner's machine.
    """

    def __init__(self, d_model: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} must be divisible by heads={heads}.")
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("future", torch.ones(seq, seq, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        d_head = d_model // self.heads
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, d_head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d_head))
        weights = scores.masked_fill(self.future[:seq, :seq], float("-inf")).softmax(dim=-1)
        weights = F.dropout(weights, self.dropout, self.training)
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, d_model)
        return F.dropout(self.proj(out), self.dropout, self.training)


class TransformerBlock(nn.Module):
    """A pre-LayerNorm GPT block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout, self.training)


class TinyTransformer(_DemoModel):
    """A GPT-style language model: token and position embeddings, ``depth`` pre-LN blocks,
    a final LayerNorm and a linear head over ``vocab`` tokens.

    >>> model = TinyTransformer(depth=2, d_model=32, heads=2, seq=16, vocab=50)
    >>> tokens, targets = model.example_batch(batch=2)
    >>> model(tokens).shape
    torch.Size([2, 16, 50])
    >>> loss = model.training_step((tokens, targets))
    >>> 3.0 < loss < 5.0    # about log(50) = 3.9 for an untrained model
    True
    """

    def __init__(self, depth: int = 4, d_model: int = 128, heads: int = 4, seq: int = 64,
                 vocab: int = 256, *, checkpointing: Checkpointing = "none", dropout: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__(checkpointing)
        sizes = {"depth": depth, "d_model": d_model, "heads": heads, "seq": seq, "vocab": vocab}
        depth, d_model, heads, seq, vocab = (integer(value, name, least=1, where="TinyTransformer")
                                             for name, value in sizes.items())
        if d_model % heads:
            raise ValueError(f"TinyTransformer: d_model={d_model} must be divisible by "
                             f"heads={heads} (each head gets d_model // heads features).")
        dropout = number(dropout, "dropout", least=0, most=1, unit="probability",
                         where="TinyTransformer")
        seed = integer(seed, "seed", where="TinyTransformer")
        self.seq, self.vocab = seq, vocab
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.token_embedding = nn.Embedding(vocab, d_model)
            self.position_embedding = nn.Embedding(seq, d_model)
            self.blocks = nn.Sequential(*(TransformerBlock(d_model, heads, seq, dropout)
                                          for _ in range(depth)))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``batch x seq x vocab`` for integer ``tokens`` of shape ``batch x seq``."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            what = (f"a tensor of dtype {tokens.dtype}" if isinstance(tokens, torch.Tensor)
                    else got(tokens)[4:])
            raise TypeError(f"TinyTransformer: tokens must be a tensor of integer token ids "
                            f"(torch.long), shape (batch, seq), got {what}.")
        if tokens.dim() != 2:
            raise ValueError(f"TinyTransformer: tokens must have shape (batch, seq), got shape "
                             f"{tuple(tokens.shape)}; for one sequence use tokens.unsqueeze(0).")
        seq = tokens.shape[1]
        if seq > self.seq:
            raise ValueError(f"TinyTransformer was built for sequences of at most {self.seq} "
                             f"tokens, got {seq}; build it with seq={seq} or shorten the input.")
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.ln_f(run_blocks(self.blocks, x, self.checkpointing)))

    def example_batch(self, batch: int = 8, seed: int = 0) -> Batch:
        """Random token sequences and their next tokens, both ``batch x seq``, on the model's
        device."""
        batch, seed = _checked_batch_size(batch, seed, "TinyTransformer.example_batch")
        generator = torch.Generator().manual_seed(seed)
        text = torch.randint(self.vocab, (batch, self.seq + 1), generator=generator)
        return text[:, :-1].to(self.device), text[:, 1:].to(self.device)

    def loss(self, batch: Batch) -> torch.Tensor:
        tokens, targets = _checked_batch(batch, "TinyTransformer.loss")
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))
