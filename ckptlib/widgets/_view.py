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
"""
from __future__ import annotations

import base64
import io
from typing import Any

import ipywidgets as widgets
from matplotlib.figure import Figure

from ckptlib import palette

# The colours of ckptlib.palette under the names the widgets have used.
PHASE_COLOURS = palette.PHASES
HIGHLIGHT = palette.HIGHLIGHT   # "this one": the current setting, the cursor, the current schedule
MUTED = palette.MUTED


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
