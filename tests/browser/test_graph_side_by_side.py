"""``SideBySide`` in a real Chromium at 1100 px: titles above, one scale, nothing cut off.

A page of its own (no JupyterLab needed): the HTML a notebook cell would show, in a row
1100 px wide, as on a laptop screen with JupyterLab's side panel open.
"""

from __future__ import annotations

import pytest

from ckptlib.graph import SideBySide, autograd_graph, torchviz_dot
from tests.graph.test_graph import checkpointed_mlp

pytestmark = pytest.mark.browser


def test_side_by_side_in_chromium_at_1100_px(browser, artifacts, tmp_path):
    model, _ = checkpointed_mlp("sqrt", depth=4)
    loss = model.loss(model.example_batch(batch=4))
    page_html = SideBySide(
        torchviz_dot(loss, params=model),
        autograd_graph(loss, params=model),
        titles=["torchviz", "ckptlib"],
    )._repr_html_()
    (tmp_path / "page.html").write_text(f"<div id=out style='width: 1100px'>{page_html}</div>")
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    try:
        page.goto((tmp_path / "page.html").as_uri())
        page.wait_for_function("Array.from(document.images).every(img => img.complete)")
        shown = page.evaluate("""() => Array.from(document.images).map(img => {
            const box = img.getBoundingClientRect(),
                title = img.previousElementSibling.getBoundingClientRect();
            return {scale: box.width / img.naturalWidth, right: box.right, top: box.top,
                titleBottom: title.bottom};
        })""")
        page.locator("#out").screenshot(path=str(artifacts / "graph_side_by_side_1100px.png"))
    finally:
        page.close()
    assert len(shown) == 2
    assert shown[0]["scale"] == pytest.approx(shown[1]["scale"], rel=0.01)
    assert all(item["right"] <= 1100 + 8 for item in shown)  # nothing past the 1100 px row
    assert all(item["titleBottom"] <= item["top"] for item in shown)  # each title above its graph
