"""What every widget of the package shares: a figure as PNG bytes, display, closing.

The widgets draw with a ``matplotlib.figure.Figure`` made without pyplot (pyplot never
learns about it, so nothing needs closing and no figure can leak however often a
widget redraws), and show it as PNG bytes: in an ``Image`` widget, or inline in HTML
when something is drawn over it. Pictures are drawn at twice the pixels they take on
screen (``png_bytes(figure, scale=2)``), so they stay sharp on a high-density screen.

A picture where the notebook is not live. A widget's view needs a running kernel and a
trusted notebook; an untrusted one, nbconvert's HTML, GitHub and the course site show
the other parts of the output instead. So a widget's output also carries an
``image/png`` of its state when it was shown (``_static_png``: by default its first
picture; a widget whose picture is HTML draws one) and a one-line ``text/plain``.
A widget at work. A measurement of a widget may take seconds to a minute, and the kernel
sends each widget update as it is made, while the work goes on. So a widget at work dims
what it is about to replace (its elements of class ``ckptlib-dims-when-busy``, while the
whole view has class ``ckptlib-running``) under a banner laid over them in the same grid
cell (:func:`busy_html`), which says what runs and how far it has got. Nothing moves when
the banner comes or goes.
"""
from __future__ import annotations

import base64
import html
import io
from typing import Any

import ipywidgets as widgets
from matplotlib.figure import Figure

from ckptlib import palette

# The colours of ckptlib.palette under the names the widgets have used.
PHASE_COLOURS = palette.PHASES
HIGHLIGHT = palette.HIGHLIGHT   # "this one": the current setting, the cursor, the current schedule
MUTED = palette.MUTED


# Include once in a widget's view (an HTML child): dims what a run is about to replace.
BUSY_STYLE = (
    "<style>.ckptlib-running .ckptlib-dims-when-busy {opacity:0.3; transition:opacity 0.2s}"
    "@keyframes ckptlib-spin {to {transform:rotate(360deg)}}</style>"
)


def busy_html(text: str) -> str:
    """The banner laid over a widget at work ("" for none): black and white, because every
    colour of the pictures under it means something."""
    if not text:
        return ""
    return (
        "<div role='status' style='white-space:normal; max-width:460px; margin:0 auto; "
        "padding:10px 16px; font-size:15px; line-height:1.4; background:white; "
        f"border:2px solid {HIGHLIGHT}; border-radius:6px; "
        "box-shadow:0 2px 8px rgba(0,0,0,0.25)'>"
        "<span style='display:inline-block; width:12px; height:12px; margin-right:8px; "
        f"border:3px solid #D0D0D0; border-top-color:{HIGHLIGHT}; border-radius:50%; "
        "animation:ckptlib-spin 1s linear infinite'></span>"
        f"<b>{html.escape(text)}</b></div>"
    )


def show_busy(view: widgets.Widget, banner: widgets.HTML, text: str) -> None:
    """Say ``text`` in ``banner`` and dim ``view``'s pictures ("" ends the busy state)."""
    banner.value = busy_html(text)
    if text:
        view.add_class("ckptlib-running")
    else:
        view.remove_class("ckptlib-running")


def over_each_other(*children: widgets.Widget) -> widgets.GridBox:
    """``children`` in one grid cell, the later ones drawn over the earlier (a busy banner over
    a picture): the cell is as large as the largest, whichever is shown."""
    for child in children:
        child.layout.grid_area = "1 / 1 / 2 / 2"
    return widgets.GridBox(list(children), layout=widgets.Layout(
        grid_template_columns="auto", justify_content="flex-start"))


def png_bytes(figure: Figure, scale: float = 1) -> bytes:
    """The figure as PNG bytes, at ``scale`` times its own dots per inch (2: sharp on a
    high-density screen when shown at the figure's size)."""
    buffer = io.BytesIO()
    # Light compression: a widget redraws on every change, and zlib's default level costs more
    # time than drawing the figure, for a picture a few KiB smaller.
    figure.savefig(buffer, format="png", dpi=figure.dpi * scale, pil_kwargs={"compress_level": 1})
    return buffer.getvalue()


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...`` for an ``<img>`` inside an HTML widget."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


class WidgetView:
    """Mixin: ``self.widget`` is the whole view; ``_text()`` its one-line text for non-widget
    front ends."""

    widget: widgets.Widget

    def _text(self) -> str:
        raise NotImplementedError

    def _static_png(self) -> bytes | None:
        """A picture of the widget's state for front ends without its view: its first picture."""
        def first_image(widget: widgets.Widget) -> bytes | None:
            if isinstance(widget, widgets.Image) and widget.value:
                return bytes(widget.value)
            return next(
                (png for child in getattr(widget, "children", ()) if (png := first_image(child))),
                None,
            )

        return first_image(self.widget)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # The widget view for JupyterLab; a picture and a short, stable text for everything else.
        bundle = self.widget._repr_mimebundle_(**kwargs)
        png = self._static_png()
        if png is not None:
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        bundle["text/plain"] = self._text()
        return bundle

    def close(self) -> None:
        """Close every widget of the view (their views go blank)."""
        def close_tree(widget: widgets.Widget) -> None:
            for child in getattr(widget, "children", ()):
                close_tree(child)
            widget.close()

        close_tree(self.widget)
