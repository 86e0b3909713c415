"""ckptlib.graph: every public function says, at the call, which argument is wrong and what it
takes.

One row per misuse: the call, the exception, and words its message must contain.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ckptlib.graph import (
    GraphNode,
    ModuleTrace,
    SideBySide,
    autograd_graph,
    render_png,
    render_svg,
    to_dot,
    torchviz_dot,
    trace_modules,
    with_statuses,
)
from ckptlib.graph.raster import svg_to_png

x = torch.randn(3, requires_grad=True)
out = x.exp().sin()
graph = autograd_graph(out)  # n0 SinBackward0 saves self, n1 ExpBackward0 saves result
weight = nn.Parameter(torch.randn(3))

MISUSES = [
    # autograd_graph
    (
        "autograd_graph(None)",
        lambda: autograd_graph(None),
        TypeError,
        ["outputs", "tensor", "NoneType"],
    ),
    ("autograd_graph('loss')", lambda: autograd_graph("loss"), TypeError, ["outputs", "str"]),
    ("autograd_graph([])", lambda: autograd_graph([]), ValueError, ["outputs", "empty"]),
    ("autograd_graph([out, 3])", lambda: autograd_graph([out, 3]), TypeError, ["output #1", "int"]),
    (
        "autograd_graph(no grad)",
        lambda: autograd_graph(torch.randn(3)),
        ValueError,
        ["output #0", "requires_grad=True"],
    ),
    (
        "autograd_graph(params=list)",
        lambda: autograd_graph(out, params=[weight]),
        TypeError,
        ["params", "nn.Module or a dict", "list"],
    ),
    (
        "autograd_graph(params key)",
        lambda: autograd_graph(out, params={1: weight}),
        TypeError,
        ["params", "key 1", "strings"],
    ),
    (
        "autograd_graph(params value)",
        lambda: autograd_graph(out, params={"a": 3.0}),
        TypeError,
        ["params['a']", "float", "not a tensor"],
    ),
    (
        "autograd_graph(modules=model)",
        lambda: autograd_graph(out, modules=nn.Linear(3, 3)),
        TypeError,
        ["modules", "trace_modules", "Linear"],
    ),
    # to_dot
    (
        "to_dot('graph')",
        lambda: to_dot("graph"),
        TypeError,
        ["to_dot", "graph", "AutogradGraph", "str"],
    ),
    ("to_dot(None)", lambda: to_dot(None), TypeError, ["to_dot", "graph", "NoneType"]),
    (
        "to_dot(tensor without grad)",
        lambda: to_dot(torch.randn(3)),
        ValueError,
        ["to_dot", "requires_grad=True"],
    ),
    (
        "to_dot(collapse='layer')",
        lambda: to_dot(graph, collapse="layer"),
        ValueError,
        ["collapse='layer'", "'module'"],
    ),
    (
        "to_dot(collapse=True)",
        lambda: to_dot(graph, collapse=True),
        TypeError,
        ["collapse", "bool", "'module'"],
    ),
    (
        "to_dot(collapse='module') untraced",
        lambda: to_dot(graph, collapse="module"),
        ValueError,
        ["trace_modules", "modules=modules"],
    ),
    ("to_dot(depth=0)", lambda: to_dot(graph, depth=0), ValueError, ["depth=0", "depth >= 1"]),
    ("to_dot(depth='2')", lambda: to_dot(graph, depth="2"), TypeError, ["depth", "int", "str"]),
    ("to_dot(depth=True)", lambda: to_dot(graph, depth=True), TypeError, ["depth", "bool"]),
    (
        "to_dot(legend='no')",
        lambda: to_dot(graph, legend="no"),
        TypeError,
        ["legend", "True or False", "str"],
    ),
    # render_svg / render_png
    (
        "render_svg(None)",
        lambda: render_svg(None),
        TypeError,
        ["render_svg", "DOT source", "NoneType"],
    ),
    ("render_svg(42)", lambda: render_svg(42), TypeError, ["render_svg", "AutogradGraph", "int"]),
    (
        "render_svg(tensor without grad)",
        lambda: render_svg(torch.randn(3)),
        ValueError,
        ["render_svg", "requires_grad=True"],
    ),
    (
        "render_svg(bad DOT)",
        lambda: render_svg("digraph { a -> }"),
        ValueError,
        ["render_svg", "rejected"],
    ),
    ("render_png(None)", lambda: render_png(None), TypeError, ["render_png", "NoneType"]),
    (
        "render_png(dpi='high')",
        lambda: render_png(graph, dpi="high"),
        TypeError,
        ["dpi", "int", "str"],
    ),
    ("render_png(dpi=0)", lambda: render_png(graph, dpi=0), ValueError, ["dpi=0", "96"]),
    (
        "render_svg(max_nodes=0)",
        lambda: render_svg(graph, max_nodes=0),
        ValueError,
        ["render_svg", "max_nodes", ">= 1", "got 0"],
    ),
    (
        "render_svg(max_nodes='10')",
        lambda: render_svg(graph, max_nodes="10"),
        TypeError,
        ["render_svg", "max_nodes", "integer", "str"],
    ),
    (
        "render_svg(max_nodes=True)",
        lambda: render_svg(graph, max_nodes=True),
        TypeError,
        ["render_svg", "max_nodes", "bool"],
    ),
    (
        "render_svg(too many nodes)",
        lambda: render_svg(graph, max_nodes=3),
        ValueError,
        ["render_svg", "the drawing has 6 nodes", "max_nodes=3", "collapse=", "max_nodes=None"],
    ),
    (
        "render_svg(timeout_s=0)",
        lambda: render_svg(graph, timeout_s=0),
        ValueError,
        ["render_svg", "timeout_s", "> 0", "got 0"],
    ),
    (
        "render_svg(timeout_s='5')",
        lambda: render_svg(graph, timeout_s="5"),
        TypeError,
        ["render_svg", "timeout_s", "number of seconds", "str"],
    ),
    (
        "render_png(timeout_s=-1)",
        lambda: render_png(graph, timeout_s=-1),
        ValueError,
        ["render_png", "timeout_s", "got -1"],
    ),
    (
        "render_png(too many nodes)",
        lambda: render_png(graph, max_nodes=1),
        ValueError,
        ["render_png", "6 nodes", "max_nodes=1"],
    ),
    ("svg_to_png(None)", lambda: svg_to_png(None), TypeError, ["svg_to_png", "str", "NoneType"]),
    ("svg_to_png('not svg')", lambda: svg_to_png("not svg"), ValueError, ["svg_to_png", "not SVG"]),
    ("svg_to_png(<html>)", lambda: svg_to_png("<html/>"), ValueError, ["svg_to_png", "<html>"]),
    # trace_modules / ModuleTrace
    (
        "trace_modules(None)",
        lambda: trace_modules(None),
        TypeError,
        ["trace_modules", "nn.Module", "NoneType"],
    ),
    (
        "trace_modules(function)",
        lambda: trace_modules(lambda t: t),
        TypeError,
        ["trace_modules", "function"],
    ),
    (
        "ModuleTrace('model')",
        lambda: ModuleTrace("model"),
        TypeError,
        ["ModuleTrace", "nn.Module", "str"],
    ),
    # torchviz_dot / SideBySide
    (
        "torchviz_dot(None)",
        lambda: torchviz_dot(None),
        TypeError,
        ["torchviz_dot", "outputs", "NoneType"],
    ),
    (
        "torchviz_dot(params=list)",
        lambda: torchviz_dot(out, params=[weight]),
        TypeError,
        ["torchviz_dot", "params", "list"],
    ),
    ("SideBySide()", lambda: SideBySide(), ValueError, ["SideBySide", "at least one graph"]),
    ("SideBySide(3)", lambda: SideBySide(3), TypeError, ["SideBySide", "graph #0", "int"]),
    (
        "SideBySide(titles='ab')",
        lambda: SideBySide(graph, titles="ab"),
        TypeError,
        ["titles", "list of strings"],
    ),
    (
        "SideBySide(too many titles)",
        lambda: SideBySide(graph, titles=["a", "b"]),
        ValueError,
        ["2 titles for 1 graphs"],
    ),
    # with_statuses, the graph's own data
    (
        "with_statuses('g')",
        lambda: with_statuses("g", {}),
        TypeError,
        ["with_statuses", "AutogradGraph", "str"],
    ),
    (
        "with_statuses(list)",
        lambda: with_statuses(graph, [("n0", "self")]),
        TypeError,
        ["statuses", "dict", "list"],
    ),
    (
        "with_statuses(key)",
        lambda: with_statuses(graph, {"n0": "freed"}),
        TypeError,
        ["key 'n0'", "pair"],
    ),
    (
        "with_statuses('released')",
        lambda: with_statuses(graph, {("n1", "result"): "released"}),
        ValueError,
        ["'released'", "'freed'"],
    ),
    (
        "with_statuses(no node)",
        lambda: with_statuses(graph, {("n99", "result"): "freed"}),
        KeyError,
        ["n99"],
    ),
    (
        "with_statuses(no tensor)",
        lambda: with_statuses(graph, {("n1", "nope"): "freed"}),
        KeyError,
        ["n1", "ExpBackward0", "'nope'", "['result']"],
    ),
    ("graph['n99']", lambda: graph["n99"], KeyError, ["n99", "n0.."]),
    (
        "SavedTensor(status='released')",
        lambda: dataclasses.replace(graph["n1"].saved[0], status="released"),
        ValueError,
        ["status='released'", "'freed'"],
    ),
    (
        "GraphNode(kind='tensor')",
        lambda: GraphNode("n0", "tensor", None),
        ValueError,
        ["kind='tensor'", "'op'"],
    ),
]


@pytest.mark.parametrize(
    "call, exception, words", [row[1:] for row in MISUSES], ids=[row[0] for row in MISUSES]
)
def test_misuse_is_a_clear_error_at_the_call(call, exception, words):
    with pytest.raises(exception) as error:
        call()
    message = str(error.value)
    missing = [word for word in words if word not in message]
    assert not missing, f"message {message!r} lacks {missing}"


def test_every_public_name_has_a_misuse_row():
    import ckptlib.graph

    callables = {name for name in ckptlib.graph.__all__ if callable(getattr(ckptlib.graph, name))}
    data_only = {
        "AutogradGraph",
        "SavedTensor",
        "NotebookDigraph",
    }  # built by the library; checked via replace
    covered = {row[0].split("(")[0].split("[")[0] for row in MISUSES} | {"AutogradGraph"}
    assert callables - data_only - covered == set()


def test_an_error_inside_trace_modules_leaves_no_hook_behind():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        with trace_modules(model):
            model(torch.randn(2, 4))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_tensor_is_drawn_directly():
    assert to_dot(out).source == to_dot(autograd_graph(out)).source
    assert render_svg(out) == render_svg(to_dot(autograd_graph(out)))
