"""ckptlib.inspect: what autograd saves, counted by hand on small models, with and without
checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckptlib import autograd_walk, checkpoint, record_trace
from ckptlib.graph import autograd_graph
from ckptlib.graph import walk as graph_walk
from ckptlib.inspect import SavedTensorsReport, record_saved, saved_tensors_report
from ckptlib.inspect import recording, walking
from ckptlib.memory import MemoryMeter
from ckptlib.models import MLPChain, TinyTransformer
from tests._grads import assert_bitwise_equal


def small_transformer(**kwargs) -> TinyTransformer:
    return TinyTransformer(depth=2, d_model=32, heads=2, seq=8, vocab=16, **kwargs)


# ---------------------------------------------------------------------------
# MLPChain, counted by hand: a = 4 * batch * width bytes per activation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_plain_mlp_keeps_input_and_one_output_per_block(depth):
    width, batch = 8, 4
    a = 4 * batch * width
    model = MLPChain(depth, width)
    x, _ = model.example_batch(batch)
    with record_saved() as saved:
        model(x)
    # Linear saves its input (mat1) and, where the input needs a gradient, its weight
    # (mat2, a view of the parameter); ReLU saves its output, the next Linear's input.
    expected = [("blocks.0.0", "AddmmBackward0", "mat1"), ("blocks.0.1", "ReluBackward0", "result")]
    for i in range(1, depth):
        expected += [
            (f"blocks.{i}.0", "AddmmBackward0", "mat1"),
            (f"blocks.{i}.0", "AddmmBackward0", "mat2"),
            (f"blocks.{i}.1", "ReluBackward0", "result"),
        ]
    assert [(row.module, row.node, row.attribute) for row in saved.rows] == expected
    assert len(saved) == 3 * depth - 1  # x needs no gradient: no weight saved in block 0
    assert saved.kept_bytes == (depth + 1) * a  # x and the D ReLU outputs, each storage once
    assert saved.state_bytes == (depth - 1) * 4 * width * width
    assert saved.dropped_bytes == 0
    relu_output = {row.storage for row in saved.rows if row.module == "blocks.0.1"}
    next_input = {
        row.storage for row in saved.rows if row.module == "blocks.1.0" and row.attribute == "mat1"
    }
    assert depth == 1 or relu_output == next_input


def test_a_weight_is_saved_only_when_the_input_needs_a_gradient():
    model = MLPChain(2, 8)
    x = model.example_batch(4)[0].requires_grad_()
    report = saved_tensors_report(lambda: model(x))
    weights = [row for row in report.rows if row.attribute == "mat2"]
    assert [row.module for row in weights] == ["blocks.0.0", "blocks.1.0"]
    assert {row.kind for row in weights} == {"parameter"}


def test_checkpoint_per_block_moves_bytes_from_kept_to_dropped():
    depth, width, batch = 4, 8, 4
    a = 4 * batch * width
    model = MLPChain(depth, width, checkpointing="block")
    x, _ = model.example_batch(batch)
    report = saved_tensors_report(lambda: model(x))
    inputs = [row for row in report.rows if row.node == "checkpoint"]
    assert [(row.attribute, row.status, row.region) for row in inputs] == [
        ("input", "kept", f"Sequential#{i}") for i in range(depth)
    ]
    assert {row.status for row in report.rows if row.node != "checkpoint"} == {"dropped"}
    # Each block's input is kept by its checkpoint; what only the dropped saves held is
    # the last block's output.
    assert report.kept_bytes == depth * a and report.dropped_bytes == a


@pytest.mark.parametrize(
    "make, mode",
    [(lambda: MLPChain(6, 8), "sqrt"), (small_transformer, "block")],
    ids=["mlp", "transformer"],
)
def test_checkpointing_moves_saved_bytes_without_losing_any(make, mode):
    model = make()
    batch = model.example_batch(batch=4)
    plain = saved_tensors_report(lambda: model.loss(batch))
    model.checkpointing = mode
    checkpointed = saved_tensors_report(lambda: model.loss(batch))
    assert checkpointed.kept_bytes < plain.kept_bytes
    assert checkpointed.kept_bytes + checkpointed.dropped_bytes == plain.kept_bytes


def test_transformer_attention_matrix_is_saved_by_softmax():
    model = small_transformer()
    tokens, _ = model.example_batch(batch=2)
    report = saved_tensors_report(lambda: model(tokens))
    softmax = [row for row in report.rows if row.op == "softmax"]
    assert [(row.module, row.node, row.attribute, row.shape) for row in softmax] == [
        (f"blocks.{i}.attn", "SoftmaxBackward0", "result", (2, 2, 8, 8)) for i in range(2)
    ]
    masks = [row for row in report.rows if row.op == "masked_fill"]
    assert {row.kind for row in masks} == {"buffer"}  # the causal mask is a module buffer


def test_module_totals_add_up():
    model = small_transformer()
    batch = model.example_batch(batch=2)
    report = saved_tensors_report(lambda: model.loss(batch))
    per_block = report.by_module(depth=2)
    assert sum(totals.kept_bytes for totals in per_block.values()) == report.kept_bytes
    assert per_block["blocks.0"] == per_block["blocks.1"]  # identical blocks save the same
    assert set(per_block) >= {"blocks.0", "blocks.1", "head", "ln_f", ""}
    assert sum(totals.tensors for totals in report.by_module().values()) == sum(
        row.kind not in ("parameter", "buffer") for row in report.rows
    )


def test_nested_plan_regions_keep_only_the_outer_input():
    from ckptlib.schedules import revolve

    model = MLPChain(4, 8, checkpointing=revolve(4, 1))
    x, _ = model.example_batch(4)
    report = saved_tensors_report(lambda: model(x))
    inputs = [row for row in report.rows if row.node == "checkpoint"]
    assert (
        len(inputs) == 1 and inputs[0].storage == report.rows[1].storage
    )  # x, then dropped by block 0
    assert len({row.region for row in report.rows if row.status == "dropped"}) == 3


# ---------------------------------------------------------------------------
# storages: shared ones counted once, views charged their whole base
# ---------------------------------------------------------------------------


def test_views_of_one_storage_count_once():
    x = torch.randn(4, 8, requires_grad=True)

    def fn():
        y = x.exp()  # saves its result: 128 bytes
        return (y.view(32) * y.t().reshape(32)).sum()  # saves views of y (and a copy of y.t())

    report = saved_tensors_report(fn)
    y_storage = report.rows[0].storage
    assert sum(row.storage == y_storage for row in report.rows) == 2
    assert report.kept_bytes == 128 + 128  # y once, and the transposed copy


def test_a_saved_view_keeps_its_whole_base():
    x = torch.randn(16, 8, requires_grad=True)
    report = saved_tensors_report(lambda: x.relu()[:2].sin())
    sin = next(row for row in report.rows if row.node == "SinBackward0")
    assert (sin.nbytes, sin.storage_bytes) == (2 * 8 * 4, 16 * 8 * 4)
    assert report.kept_bytes == 16 * 8 * 4


def test_parameters_are_listed_but_not_counted():
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    report = saved_tensors_report(lambda: linear(x))
    assert {row.kind for row in report.rows} == {"activation", "parameter"}
    assert report.kept_bytes == 2 * 8 * 4 and report.state_bytes == 8 * 8 * 4


def test_custom_function_saves_are_named_by_the_next_call():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = torch.randn(3, requires_grad=True)
    report = saved_tensors_report(lambda: Square.apply(x).sin())
    assert [(row.node, row.attribute) for row in report.rows] == [
        ("SquareBackward", "saved_tensors"),
        ("SinBackward0", "self"),
    ]


# ---------------------------------------------------------------------------
# walking an existing graph
# ---------------------------------------------------------------------------


def test_walking_a_plain_graph_finds_what_recording_found():
    model = small_transformer()
    batch = model.example_batch(batch=2)
    recorded = saved_tensors_report(lambda: model.loss(batch))
    loss = model.loss(batch)
    walked = saved_tensors_report(loss, model)  # model: to know its buffers
    key = lambda row: (row.node, row.attribute, row.shape, row.dtype, row.kind)  # noqa: E731
    # `scores * (1 / sqrt(d_head))` saves the Python number as a 0-dim float64 tensor that
    # autograd never passes to saved-tensor hooks: only the walk sees it (once per block).
    scalars = [
        row for row in walked.rows if key(row)[:4] == ("MulBackward0", "other", (), torch.float64)
    ]
    assert len(scalars) == 2
    assert sorted((key(row) for row in walked.rows if row not in scalars), key=str) == sorted(
        map(key, recorded.rows), key=str
    )
    assert walked.kept_bytes == recorded.kept_bytes + 2 * 8
    assert {row.module for row in walked.rows} == {""}  # a graph does not know its modules
    unaided = saved_tensors_report(loss)  # without the model: the mask looks like an activation
    assert unaided.kept_bytes == walked.kept_bytes + 2 * 8 * 8


def test_walking_a_checkpointed_graph_reports_dropped_without_recomputing():
    model = MLPChain(3, 8, checkpointing="block")
    x = model.example_batch(4)[0].requires_grad_()
    out = model(x)
    with record_trace() as trace:
        report = saved_tensors_report(out)
    assert trace.count("recompute") == 0
    assert [row.status for row in report.rows] == ["dropped"] * 9
    assert {row.kind for row in report.rows} == {"unknown"}  # a dropped tensor's identity is gone
    assert {row.region for row in report.rows} == {"Sequential#0", "Sequential#1", "Sequential#2"}
    out.sum().backward()  # still trains normally afterwards
    assert x.grad is not None


@pytest.mark.parametrize(
    "make, mode",
    [(lambda: MLPChain(5, 8), "sqrt"), (small_transformer, "none")],
    ids=["mlp-sqrt", "transformer"],
)
def test_the_report_and_the_graph_read_the_same_saved_tensors(make, mode):
    # One walker (ckptlib.autograd_walk) behind both: the same nodes in the same order, the same
    # saved tensors with the same bytes and states, and the same kept total.
    for inspect_module in (recording, walking):
        assert inspect_module.read_saved is graph_walk.read_saved is autograd_walk.read_saved
        assert inspect_module.walk is graph_walk.walk is autograd_walk.walk
    model = make()
    model.checkpointing = mode
    loss = model.loss(model.example_batch(batch=2))
    graph = autograd_graph(loss, params=model)
    report = saved_tensors_report(loss, model)
    as_row = {"kept": "kept", "dropped": "dropped", "recomputed": "dropped"}
    per_node = [
        (node.op, [(s.name, s.nbytes, as_row[s.status]) for s in node.saved])
        for node in graph.ops
        if node.saved
    ]
    rows = [(row.node, row.attribute, row.nbytes, row.status) for row in report.rows]
    assert [(op, *saved) for op, saves in per_node for saved in saves] == rows
    assert graph.saved_bytes == report.kept_bytes > 0
    assert any(status == "dropped" for *_, status in rows) == (mode != "none")


def test_walking_a_torch_checkpoint_graph_does_not_recompute():
    x = torch.randn(4, 8, requires_grad=True)
    runs = []

    def block(t):
        runs.append(1)
        return t.sin().exp()

    out = torch_checkpoint(block, x, use_reentrant=False)
    report = saved_tensors_report(out)
    assert len(runs) == 1  # reading ran nothing again
    assert [
        (row.node, row.attribute, row.shape, row.status, row.region) for row in report.rows
    ] == [
        ("ExpBackward0", "result", (4, 8), "dropped", "torch.utils.checkpoint#0"),
        ("SinBackward0", "self", (4, 8), "dropped", "torch.utils.checkpoint#0"),
    ]
    assert report.kept_bytes == 0 and report.dropped_bytes == 2 * 4 * 8 * 4
    out.sum().backward()  # still trains normally afterwards
    assert len(runs) == 2 and x.grad is not None


def test_recording_does_not_recompute_either():
    model = MLPChain(3, 8, checkpointing="block")
    x, _ = model.example_batch(4)
    with record_trace() as trace:
        saved_tensors_report(lambda: model(x))
    assert trace.count("recompute") == 0
    assert trace.count("pack") == 2 + 3 + 3  # x needs no gradient: block 0 saves no weight


def test_a_graph_after_backward_has_nothing_saved():
    x = torch.randn(8, requires_grad=True)
    y = x.exp().sum()
    assert len(saved_tensors_report(y)) == 1
    y.backward()
    assert len(saved_tensors_report(y)) == 0


def test_saves_under_another_hook_are_marked_hooked_and_not_counted():
    model = MLPChain(2, 8, checkpointing="torch")
    x, _ = model.example_batch(4)
    report = saved_tensors_report(lambda: model(x))
    inside = [row for row in report.rows if row.module.startswith("blocks.")]
    assert inside and {row.status for row in inside} == {"hooked"}
    assert report.dropped_bytes == 0


# ---------------------------------------------------------------------------
# recording changes nothing and leaves nothing behind
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "block", "torch"])
def test_gradients_are_unchanged_under_record_saved(mode):
    model = small_transformer(checkpointing=mode, dropout=0.1)
    batch = model.example_batch(batch=2)
    torch.manual_seed(0)
    model.training_step(batch)
    expected = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(0)
    with record_saved():
        model.training_step(batch)
    assert_bitwise_equal([p.grad for p in model.parameters()], expected)


def test_record_saved_keeps_no_activation_alive():
    # Packing the tensor itself would make a saved output hold its own grad_fn: a cycle.
    model = MLPChain(3, 8)
    x, _ = model.example_batch(4)
    with MemoryMeter() as meter:
        with record_saved():
            out = model(x)
        del out
    assert meter.live_bytes == 0


def test_hooks_and_modes_are_removed_even_after_an_error():
    hooks_before = dict(torch.nn.modules.module._global_forward_hooks)
    with pytest.raises(ZeroDivisionError):
        with record_saved():
            torch.randn(3, requires_grad=True).exp()
            1 / 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert dict(torch.nn.modules.module._global_forward_hooks) == hooks_before
    assert not torch.overrides._is_torch_function_mode_enabled()


# ---------------------------------------------------------------------------
# output: deterministic table, machine-readable rows
# ---------------------------------------------------------------------------


def test_the_table_is_deterministic_across_runs():
    model = small_transformer(checkpointing="block")
    batch = model.example_batch(batch=2)
    first = str(saved_tensors_report(lambda: model.loss(batch)))
    second = str(
        saved_tensors_report(lambda: model.loss(batch))
    )  # new region numbers inside ckptlib
    assert first == second
    assert "TransformerBlock#1" in first and "0x" not in first and "@" not in first


def test_table_layout():
    x = torch.randn(2, 3, requires_grad=True)
    report = saved_tensors_report(lambda: checkpoint(torch.sin, x).exp())
    assert str(report).splitlines() == [
        "module  op          node          saved   shape  dtype    bytes  storage  kind"
        "        status   region",
        "-       checkpoint  checkpoint    input   2x3    float32  24 B   s0       activation"
        "  kept     sin#0",
        "-       sin         SinBackward0  self    2x3    float32  24 B   s0       activation"
        "  dropped  sin#0",
        "-       exp         ExpBackward0  result  2x3    float32  24 B   s1       activation"
        "  kept     -",
        "activations kept: 48 B in 2 storages",
        "activations dropped by checkpoints: 0 B",
    ]
    assert repr(report) == "SavedTensorsReport(3 saved tensors, kept 48 B, dropped 0 B)"


def test_records_are_plain_json():
    model = MLPChain(2, 8)
    report = saved_tensors_report(lambda: model.loss(model.example_batch(4)))
    records = json.loads(json.dumps(report.records()))
    assert records[0] == {
        "module": "blocks.0.0",
        "op": "linear",
        "node": "AddmmBackward0",
        "attribute": "mat1",
        "shape": [4, 8],
        "dtype": "float32",
        "nbytes": 128,
        "storage": "s0",
        "storage_bytes": 128,
        "kind": "activation",
        "status": "kept",
        "region": "",
    }
    assert records[-1]["op"] == "mse_loss" and records[-1]["module"] == ""


def test_empty_report():
    report = SavedTensorsReport()
    assert (report.kept_bytes, report.dropped_bytes, len(report)) == (0, 0, 0)
    with torch.no_grad():
        assert len(saved_tensors_report(lambda: F.relu(torch.randn(3)))) == 0


def test_a_walked_report_gives_a_dropped_tensor_two_nodes_saved_one_storage():
    # ReLU's result is also cos's saved input: one autograd output, one storage, whose bytes
    # count once (the walk used to give each save its own storage).
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(lambda t: t.sin().relu().cos(), x).sum()
    report = saved_tensors_report(out)
    rows = {(row.node, row.attribute): row for row in report.rows}
    relu, cos = rows["ReluBackward0", "result"], rows["CosBackward0", "self"]
    assert relu.status == cos.status == "dropped" and relu.storage == cos.storage
    assert rows["SinBackward0", "self"].storage != relu.storage
    assert report.dropped_bytes == 2 * 3 * 4 * 4   # sin's input (x) and the ReLU's result
