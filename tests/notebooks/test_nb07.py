"""Claims notebook 07, beyond, makes in prose, checked on the installed torch.

The notebooks measure these in their cells (nbval compares the committed outputs); the tests
here keep the claims true when torch or ckptlib changes, without running a notebook, and check
the few that a cell cannot show (FSDP2's parameter gathers).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ckptlib
from ckptlib import (
    MemoryMeter,
    TinyTransformer,
    offload_saved_tensors,
    save_matmuls,
    selective_checkpoint,
)
from ckptlib.widgets import PolicyExplorer

aten = torch.ops.aten
KIB = 1024


# ---------------------------------------------------------------------------
# Notebook 07, section 2: save_on_cpu() on a CPU keeps the tensor itself
# ---------------------------------------------------------------------------


def graphs_left_alive(hooks) -> int:
    """How many of 3 dropped `v.exp()` graphs made under `hooks` survive gc.collect() (as in 07 and
    02)."""
    v = torch.randn(1000, requires_grad=True)
    outputs = []
    for _ in range(3):
        with hooks() if hooks else contextlib.nullcontext():
            out = v.exp()
        outputs.append(weakref.ref(out))
        del out
    gc.collect()
    return sum(output() is not None for output in outputs)


def test_save_on_cpu_on_cpu_tensors_leaks_every_graph_dropped_before_backward():
    # tensor.cpu() returns the CPU tensor itself; exp saves its output, which holds its grad_fn:
    # a reference cycle through C++ that the garbage collector cannot see.
    assert graphs_left_alive(torch.autograd.graph.save_on_cpu) == 3


@pytest.mark.parametrize(
    "hooks",
    [
        None,
        offload_saved_tensors,
        functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=True),
    ],
    ids=["plain", "ckptlib offload", "save_on_cpu pinned"],
)
def test_hooks_that_keep_no_grad_fn_leak_nothing(hooks):
    assert graphs_left_alive(hooks) == 0


def test_save_on_cpu_after_backward_keeps_nothing():
    """The cycle is broken by backward: graphs that run backward are freed."""
    v = torch.randn(1000, requires_grad=True)
    outputs = []
    for _ in range(3):
        with torch.autograd.graph.save_on_cpu():
            out = v.exp()
        out.sum().backward()
        outputs.append(weakref.ref(out))
        del out
    gc.collect()
    assert all(output() is None for output in outputs)


def test_on_cpu_save_on_cpu_adds_no_bytes_and_pinning_copies_every_saved_tensor():
    blocks = TinyTransformer(depth=2, d_model=64, heads=4, seq=64).blocks
    x = torch.randn(1, 64, 64, requires_grad=True)

    def kept_bytes(hooks):
        with MemoryMeter("cpu", backend="tensors", timeline=False) as meter:
            with hooks() if hooks else contextlib.nullcontext():
                out = blocks(x)
            kept = meter.live_bytes
        del out
        return kept

    plain = kept_bytes(None)
    assert kept_bytes(torch.autograd.graph.save_on_cpu) == plain
    assert kept_bytes(offload_saved_tensors) == plain
    assert kept_bytes(functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=True)) > plain


# ---------------------------------------------------------------------------
# Notebook 07, section 1: what save_matmuls keeps, and what a rerun skips
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformer():
    """The four blocks of notebook 07 and their input."""
    torch.manual_seed(0)
    model = TinyTransformer(depth=4, d_model=64, heads=4, seq=64)
    return model.blocks, torch.randn(1, 64, 64, requires_grad=True)


class OpOutputs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.calls.append((func, output))
        return output


def test_half_the_matmul_output_bytes_of_a_block_are_ones_plain_autograd_does_not_keep(transformer):
    blocks, x = transformer
    saved = set()

    def note(tensor):
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor.detach()

    with OpOutputs() as ops, torch.autograd.graph.saved_tensors_hooks(note, lambda tensor: tensor):
        blocks[0](x)
    outputs = [output for func, output in ops.calls if func in save_matmuls]
    assert [tuple(o.shape) for o in outputs] == [
        (64, 192),
        (4, 64, 64),
        (4, 64, 16),
        (64, 64),
        (64, 256),
        (64, 64),
    ]
    assert sum(o.nbytes for o in outputs) == 224 * KIB
    not_saved = [o for o in outputs if o.untyped_storage().data_ptr() not in saved]
    assert sum(o.nbytes for o in not_saved) == 112 * KIB
    assert (4, 64, 64) in [tuple(o.shape) for o in not_saved], (
        "plain autograd keeps the attention scores"
    )


def _kept_bytes(blocks, x, runner) -> int:
    with MemoryMeter("cpu", backend="tensors", timeline=False) as meter:
        h = x
        for block in blocks:
            h = runner(block, h)
        kept = meter.live_bytes
    return kept


def test_save_matmuls_keeps_the_inputs_and_every_matmul_output_in_ckptlib_and_torch_sac(
    transformer,
):
    blocks, x = transformer
    torch_sac = functools.partial(create_selective_checkpoint_contexts, list(save_matmuls))
    ours = _kept_bytes(blocks, x, functools.partial(selective_checkpoint, policy=save_matmuls))
    theirs = _kept_bytes(blocks, x, lambda block, h: torch_checkpoint(block, h, use_reentrant=False,
                                                                      context_fn=torch_sac))
    assert ours == theirs == 4 * 16 * KIB + 4 * 224 * KIB


class BackwardOps(TorchDispatchMode):
    """The aten ops that run (not views, not the meta stand-ins of skipped calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and str(kwargs.get("device")) != "meta":
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)


def _backward_ops(block, x, run) -> Counter:
    """The ops of one backward through `run(block, x)`, rerun included (gradients of x only, so
    no parameter gradient is accumulated differently from one run to the next)."""
    out = run(block, x)
    with BackwardOps() as log:
        torch.autograd.grad(out.sum(), x)
    return log.ops


def test_keeping_the_softmax_ckptlib_skips_the_scores_scaling_and_mask_torch_sac_runs_them(
    transformer,
):
    blocks, x = transformer
    torch_sac = functools.partial(create_selective_checkpoint_contexts, [aten._softmax.default])
    theirs = _backward_ops(
        blocks[0],
        x,
        lambda block, h: torch_checkpoint(block, h, use_reentrant=False, context_fn=torch_sac),
    )
    ours = _backward_ops(
        blocks[0], x, functools.partial(selective_checkpoint, policy={aten._softmax})
    )
    assert theirs - ours == Counter({"bmm": 1, "mul": 1, "masked_fill": 1})
    assert ours - theirs == Counter()


def test_keeping_both_bmm_outputs_skips_nothing_before_them(transformer):
    blocks, x = transformer
    full = _backward_ops(blocks[0], x, ckptlib.checkpoint)
    keep_bmm = _backward_ops(
        blocks[0], x, functools.partial(selective_checkpoint, policy={aten.bmm})
    )
    assert full - keep_bmm == Counter({"bmm": 2}), "only the two replayed products may be missing"


# ---------------------------------------------------------------------------
# Notebook 07, section 1, the explorer: what one kept output spares in the rerun
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_explorer():
    """The explorer of notebook 07: one block of the section's sizes, batch 1."""
    explorer = PolicyExplorer(TinyTransformer(depth=1, d_model=64, heads=4, seq=64), batch=1)
    yield explorer
    explorer.close()


def _keep_rows(explorer, rows) -> dict:
    explorer.select(lambda row: explorer.rows.index(row) in rows)
    return explorer.result


def test_keeping_fc2s_output_spares_no_call_of_the_rerun(policy_explorer):
    fc2 = len(policy_explorer.rows) - 1
    assert policy_explorer.rows[fc2]["op"] == "addmm" and policy_explorer.rows[fc2]["input_shapes"][
        1
    ] == (64, 256)
    kept = _keep_rows(policy_explorer, [fc2])
    assert kept["kept_bytes"] == 16 * KIB
    assert kept["rerun_ops"] == policy_explorer.references["full checkpoint"]["rerun_ops"] == 13


def test_within_half_of_save_matmuls_bytes_the_rerun_computes_5_calls(policy_explorer):
    matmuls = policy_explorer.references["save_matmuls"]
    assert (matmuls["kept_bytes"], matmuls["rerun_ops"]) == (224 * KIB, 8)
    ops = [row["op"] for row in policy_explorer.rows]
    softmax, clone, add = ops.index("_softmax"), ops.index("clone"), ops.index("add")
    assert softmax == 5, "the notebook's committed first try names the softmax by its row number"
    assert (
        _keep_rows(policy_explorer, [softmax])["rerun_ops"] == 9
    )  # itself and the 3 ops that only fed it
    spare_more = []                    # 16 KiB rows that spare more than their own call
    for row in range(len(ops)):
        kept = _keep_rows(policy_explorer, [row])
        if kept["kept_bytes"] == 16 * KIB and kept["rerun_ops"] < 12:
            spare_more.append((row, kept["rerun_ops"]))
    assert spare_more == [(clone, 11), (add, 11)]
    for row in (clone, add):         # the softmax and one of them
        kept = _keep_rows(policy_explorer, [softmax, row])
        assert (kept["kept_bytes"], kept["rerun_ops"]) == (80 * KIB, 7)
    best = _keep_rows(policy_explorer, [softmax, clone, add])
    assert (best["kept_bytes"], best["rerun_ops"]) == (96 * KIB, 5)


# ---------------------------------------------------------------------------
# Notebook 07, section 3: FSDP2 gathers nothing more for a recomputation
# ---------------------------------------------------------------------------


def test_fsdp2_recomputation_uses_the_parameters_gathered_for_backward(monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    group_module = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    import socket

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        unshards: list[str] = []
        original = group_module.FSDPParamGroup.unshard

        def counting_unshard(self, *args, **kwargs):
            unshards.append(self._module_fqn)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(group_module.FSDPParamGroup, "unshard", counting_unshard)
        gathers, forwards = {}, {}
        for checkpointing in ("none", "block"):
            model = TinyTransformer(
                depth=2, d_model=32, heads=2, seq=16, vocab=64, checkpointing=checkpointing
            )
            calls = []
            for block in model.blocks:
                block.register_forward_pre_hook(lambda module, args: calls.append(1))
                fsdp.fully_shard(block)
            fsdp.fully_shard(model)
            unshards.clear()
            model.training_step(model.example_batch(batch=4))
            gathers[checkpointing], forwards[checkpointing] = Counter(unshards), len(calls)
        assert forwards == {"none": 2, "block": 4}, "each checkpointed block reran its forward"
        assert gathers["block"] == gathers["none"]
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Notebook 07, section 4: ckptlib.checkpoint runs eagerly between two compiled graphs;
# torch.utils.checkpoint is one region in one graph
# ---------------------------------------------------------------------------


def test_ckptlib_checkpoint_is_a_graph_break_between_two_compiled_graphs():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    x = torch.randn(64, 32, requires_grad=True)
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append([node.name for node in graph_module.graph.nodes
                       if node.op in ("call_function", "call_method", "call_module")])
        return graph_module.forward

    def with_ckptlib(inp):
        return ckptlib.checkpoint(mlp, inp * 2).sin()

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(with_ckptlib)(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (2, 1)
    assert "torch.compiler.disable" in explanation.break_reasons[0].reason
    torch._dynamo.reset()
    torch.compile(with_ckptlib, backend=recording_backend)(x).sum().backward()
    assert graphs == [["mul"], ["sin"]], "the checkpointed MLP itself is not compiled"
    torch._dynamo.reset()


def test_torch_checkpoint_compiles_without_a_graph_break():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    x = torch.randn(64, 32, requires_grad=True)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(
        lambda inp: torch_checkpoint(mlp, inp, use_reentrant=False).sin()
    )(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
