"""What every widget of the package shares: a figure as PNG bytes, display, closing.

The widgets draw with a ``matplotlib.figure.Figure`` made without pyplot (pyplot never
learns about it, so nothing needs closing and no figure can leak however often a
widget redraws), and show it as PNG bytes: in an ``Image`` widget, or inline in HTML
when something is drawn over it.
"""
from __future__ import annotations

import base64
import io
from typing import Any

import ipywidgets as widgets
from matplotlib.figure import Figure

PHASE_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "recompute": "#55A868"}
HIGHLIGHT = "#C44E52"   # "this one": the current setting, the cursor, the current schedule
MUTED = "#8C8C8C"


def png_bytes(figure: Figure) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...`` for an ``<img>`` inside an HTML widget."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


class WidgetView:
    """Mixin: ``self.widget`` is the whole view; ``_text()`` its one-line text for non-widget front ends."""

    widget: widgets.Widget

    def _text(self) -> str:
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # The widget view for JupyterLab; a short, stable text for everything else.
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = self._text()
        return bundle

    def close(self) -> None:
        """Close every widget of the view (their views go blank)."""
        def close_tree(widget: widgets.Widget) -> None:
            for child in getattr(widget, "children", ()):
                close_tree(child)
            widget.close()

        close_tree(self.widget)
