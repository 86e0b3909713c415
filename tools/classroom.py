"""Build the course for a classroom: offline reveal.js slides and a static site.

    python tools/classroom.py slides [OUT]
        # OUT (build/slides): one reveal.js deck per notebook
    python tools/classroom.py site [OUT]
        # OUT (build/site): README, notebooks, solutions, guide, figures
    python tools/classroom.py check OUT
        # every link or asset in OUT that would not load offline

Everything opens from disk (file://) with no network. nbconvert's templates load reveal.js,
require.js, MathJax, jQuery and the Jupyter widgets HTML manager from CDNs; here they load
copies under OUT/_static instead, taken from the npm packages pinned in tools/package.json and
tools/package-lock.json (`npm ci` installs them into tools/node_modules on first use).

Links between documents keep working: a relative link to a notebook or markdown file that is
built points at its page (`03_x.ipynb` -> `03_x.html` on the site, `03_x.slides.html` among the
slides), and any other repository file a page links to (a .py source) is copied next to it.
The site mirrors the repository's layout (notebooks/03_x.html, docs/instructor.html; README.md
becomes index.html), with a table of contents on every page.

Slides that fit. The decks use a 16:9 canvas (1280 x 720) and tools/classroom_static/slides.js,
which runs before reveal.js starts: a code or output block with lines too long for the slide
gets a smaller font (down to 13 px from 19), then wraps; a slide a little too tall is shrunk
(to 85% at most); a taller one is split between cells into vertical slides headed
"... (continued)", so a presenter only ever presses "next" (right arrow or space: the decks
navigate linearly) and nothing is below the fold. Only a single cell taller than the canvas by
itself scrolls (shrunk to 60% first), and then each fragment scrolls into view as it appears.
The slides index lists the notebooks by title in course order, each with its solutions.

Widgets. A page has no kernel, so a widget output can only be a snapshot, and it must be the
one its cell showed: the widget state saved with a notebook is the state at the end, after
later cells moved the widget on (prose about Revolve above a picture of sqrt(n)). So a widget
output that carries its own picture (an image/png taken when the cell displayed it) is shown as
that picture; only one without a picture falls back to the saved state, and says so. Each gets a
visible note saying what it is and where to run it; one whose saved state is incomplete (or
needs a widget library the static page cannot load) is replaced by a note naming it, rather
than an empty box (see static_widgets). In a deck, a widget's output moves to the slide after
its code (slides_apart), so the widget has the canvas to itself instead of being shrunk.
"""
from __future__ import annotations

import base64
import copy
import functools
import html
import json
import posixpath
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from typing import Callable
from urllib.parse import unquote, urlsplit

import nbformat
from nbconvert import HTMLExporter, SlidesExporter
from nbconvert.exporters import TemplateExporter
from traitlets.config import Config

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
NODE_MODULES = TOOLS / "node_modules"
STATIC = "_static"
# our own slides.js and slides.css, copied to _static/course
COURSE_STATIC = TOOLS / "classroom_static"
SLIDE_WIDTH, SLIDE_HEIGHT = 1280, 720          # the reveal.js canvas: 16:9, what projectors show
# a cell tag: a deck shows the cell's outputs, not its code
OUTPUTS_ONLY = "course-outputs-only"

# What the pages load, as paths inside node_modules; copied to OUT/_static/<same path>.
VENDORED = (
    "reveal.js/dist", "reveal.js/plugin/notes", "reveal.js/LICENSE",
    "requirejs/require.js",
    "jquery/dist/jquery.min.js", "jquery/LICENSE.txt",
    "mathjax/MathJax.js", "mathjax/config/TeX-AMS_CHTML-full.js", "mathjax/config/Safe.js",
    "mathjax/extensions", "mathjax/jax/input/TeX", "mathjax/jax/output/CommonHTML",
    "mathjax/jax/element", "mathjax/fonts/HTML-CSS/TeX/woff", "mathjax/LICENSE",
    "@jupyter-widgets/html-manager/dist",
)
# Source maps, ES-module builds and the non-AMD widgets bundle: no page loads them.
NOT_LOADED = ("*.map", "*.esm.js", "embed.js", "libembed-amd.js")

# Blocks both templates replace.
# - Mermaid is imported from a CDN as an ES module, and no course notebook draws a diagram.
# - The widgets bundle (embed-amd.js) sets webpack's public path, where it finds its fonts, from
#   the require.js URLs of the modules it defines, so require.js must map those names to its
#   folder.
# - Code input skips nbconvert's bleach pass (a third of the build time): it sanitises Pygments'
#   own escaped rendering of our own notebooks, so it changes nothing here.
COMMON_BLOCKS = """
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_js_requirejs -%}
{{ super() }}
<script>
require.config({paths: {
  "@jupyter-widgets": "{{ resources.static_url }}/@jupyter-widgets/html-manager/dist",
  "@jupyter-widgets/html-manager/dist": \
"{{ resources.static_url }}/@jupyter-widgets/html-manager/dist"
}});
</script>
{%- endblock html_head_js_requirejs -%}
{% block input %}
<div class="jp-CodeMirrorEditor jp-Editor jp-InputArea-editor" data-type="inline">
<div class="cm-editor cm-s-jupyter">
{{ cell.source | highlight_code(metadata=cell.metadata) }}
</div>
</div>
{%- endblock input %}
"""
# The decks start reveal.js through slides.js, which first makes every slide fit (see the module
# notes); nbconvert's own start-up script (and its "scroll" option) is replaced.
SLIDES_TEMPLATE = "{%- extends 'index.html.j2' -%}" + COMMON_BLOCKS + """
{% block notebook_css %}{{ super() }}
<link rel="stylesheet" href="{{ resources.static_url }}/course/slides.css">
<style>{{ resources.cjk_css }}</style>
{% endblock notebook_css %}
{% block footer_js %}
<script src="{{ resources.static_url }}/course/slides.js"></script>
<script>
require({waitSeconds: 15},
  ["{{ resources.reveal.url_prefix }}/dist/reveal.js", \
"{{ resources.reveal.url_prefix }}/plugin/notes/notes.js"],
  function (Reveal, RevealNotes) {
    courseSlides.start(Reveal, {
      controls: true, progress: true, history: true, plugins: [RevealNotes],
      navigationMode: "linear",   // right arrow walks into subslides and continuations too
      transition: "{{ resources.reveal.transition }}", slideNumber: "{{ resources.reveal.number }}",
      width: {{ resources.reveal.width }}, height: {{ resources.reveal.height }}
    });
  });
</script>
{% endblock footer_js %}
"""
# The site's pages get their table of contents and previous / next links once all are rendered.
TOC_MARK, PAGER_MARK = "<!-- course-toc -->", "<!-- course-pager -->"
SITE_TEMPLATE = "{%- extends 'index.html.j2' -%}" + COMMON_BLOCKS + """
{%- block html_head_css -%}<style type="text/css">{{ resources.site_css }}</style>\
{%- endblock html_head_css -%}
{%- block body_header -%}{{ super() }}
<!-- course-toc -->
{%- endblock body_header -%}
{%- block body_footer -%}<!-- course-pager -->
{{ super() }}{%- endblock body_footer -%}
"""
# The seed article's Chinese title: a family that names the CJK fonts a machine may have (CI
# installs Debian's fonts-noto-cjk), used for CJK characters only (unicode-range), first in the
# pages' font lists; Latin text falls through to the next family. Without it, a browser whose
# default fonts have no CJK glyphs draws empty boxes.
CJK_CSS = """
@font-face { font-family: "Course CJK";
  src: local("Noto Sans CJK SC"), local("NotoSansCJKsc-Regular"), local("Noto Sans SC"),
       local("Source Han Sans SC"), local("WenQuanYi Micro Hei"), local("PingFang SC"),
       local("Microsoft YaHei");
  unicode-range: U+3000-303F, U+3400-4DBF, U+4E00-9FFF, U+F900-FAFF, U+FF00-FFEF; }
.reveal { font-family: "Course CJK", "Source Sans Pro", Helvetica, sans-serif; }
.jp-RenderedMarkdown { font-family: "Course CJK", var(--jp-content-font-family); }
"""
SITE_CSS = CJK_CSS + """
.course-toc { font-family: var(--jp-ui-font-family); font-size: 14px; line-height: 1.5; }
.course-toc ul { list-style: none; padding-left: 0; margin: 0.2em 0; }
.course-toc ul ul { padding-left: 1.2em; font-size: 13px; }
.course-toc li { margin: 0.3em 0; }
.course-toc .current > a { font-weight: bold; }
.course-toc .course-solutions { font-size: 12px; margin-left: 0.4em; }
.jp-RenderedMarkdown pre { background: var(--jp-cell-editor-background); padding: 8px; }
.course-pager { display: flex; justify-content: space-between; gap: 1em; margin: 2em 0 1em;
                font-family: var(--jp-ui-font-family); }
@media (min-width: 1200px) {
  .course-toc { position: fixed; top: 0; left: 0; bottom: 0; width: 300px; overflow-y: auto;
                padding: 16px; box-sizing: border-box; \
border-right: 1px solid var(--jp-border-color2);
                background: var(--jp-layout-color1); }
  body.jp-Notebook { padding-left: 320px; }
}
@media (max-width: 1199px) { .course-toc ul ul { display: none; } }
"""

# repository path of a document -> its page, relative to OUT
Pages = dict[PurePosixPath, PurePosixPath]
# document -> its (level, id, text) headings
Headings = dict[PurePosixPath, list[tuple[int, str, str]]]


def notebooks() -> list[Path]:
    """The course notebooks in order: notebooks/NN_topic.ipynb."""
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def solutions() -> list[Path]:
    """The solution notebooks: notebooks/solutions/NN_topic_solutions.ipynb."""
    return sorted((ROOT / "notebooks" / "solutions").glob("[0-9][0-9]_*_solutions.ipynb"))


class AssetsUnavailable(RuntimeError):
    """The pinned npm packages are not installed and `npm ci` cannot install them."""


def install_assets() -> Path:
    """Run `npm ci` in tools/ unless node_modules already matches package-lock.json."""
    lock, installed = TOOLS / "package-lock.json", NODE_MODULES / ".package-lock.json"
    if installed.exists() and installed.stat().st_mtime >= lock.stat().st_mtime:
        return NODE_MODULES
    npm = shutil.which("npm")
    if npm is None:
        raise AssetsUnavailable(
            "npm not found: the offline slides and site copy reveal.js, MathJax and require.js "
            "from the npm packages pinned in tools/package-lock.json. Install Node.js 18 or newer "
            "(apt-get install nodejs npm, brew install node, or conda install nodejs) and run "
            "again.")
    # --ignore-scripts: the packages are only files to copy; none needs an install step.
    command = [npm, "ci", "--prefix", str(TOOLS), "--ignore-scripts", "--no-audit", "--no-fund"]
    if subprocess.run(command).returncode != 0:
        raise AssetsUnavailable(f"`npm {' '.join(command[1:])}` failed (its output is above): "
                                "it needs the npm registry once, to fill tools/node_modules; "
                                "run it again when online.")
    return NODE_MODULES


def copy_assets(out: Path, *, slides: bool) -> None:
    """Copy the vendored scripts, styles and fonts to out/_static (reveal.js and ours only for
    slides)."""
    if slides:
        shutil.copytree(COURSE_STATIC, out / STATIC / "course", dirs_exist_ok=True)
    modules = install_assets()
    for relative in VENDORED:
        if relative.startswith("reveal.js/") and not slides:
            continue
        source, target = modules / relative, out / STATIC / relative
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns(*NOT_LOADED),
                            dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def static_prefix(page: PurePosixPath) -> str:
    """The relative URL from a page (a path relative to OUT) to OUT/_static.

    >>> static_prefix(PurePosixPath("notebooks/solutions/03_x_solutions.html"))
    '../../_static'
    """
    return posixpath.join(*[".."] * len(page.parent.parts), STATIC)


def asset_config(prefix: str) -> Config:
    """nbconvert settings that load every script from prefix (see static_prefix) instead of CDNs."""
    config = Config()
    config.HTMLExporter.require_js_url = f"{prefix}/requirejs/require.js"
    config.HTMLExporter.jquery_url = f"{prefix}/jquery/dist/jquery.min.js"
    # MathJax.js, not the CDN's latest.js: latest.js asks the network for a newer version first.
    config.HTMLExporter.mathjax_url = f"{prefix}/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"
    config.HTMLExporter.widget_renderer_url = (
        f"{prefix}/@jupyter-widgets/html-manager/dist/embed-amd.js")
    config.SlidesExporter.reveal_url_prefix = f"{prefix}/reveal.js"
    # its fonts ship with reveal.js; "simple" asks Google Fonts
    config.SlidesExporter.reveal_theme = "white"
    config.SlidesExporter.reveal_width, config.SlidesExporter.reveal_height = (
        str(SLIDE_WIDTH), str(SLIDE_HEIGHT))
    config.SlidesExporter.reveal_number = "c/t"  # "12/40", so the room can say which slide
    config.TagRemovePreprocessor.enabled = True
    config.TagRemovePreprocessor.remove_input_tags = {OUTPUTS_ONLY}   # see slides_apart
    return config


def _exporters(kind: type[TemplateExporter], template: str) -> Callable[[str], TemplateExporter]:
    """One configured exporter per static prefix (pages at the same depth share one)."""
    return functools.cache(lambda prefix: kind(config=asset_config(prefix), raw_template=template))


def _render(exporter: Callable[[str], TemplateExporter], nb: nbformat.NotebookNode, name: str,
            page: PurePosixPath, **resources: str) -> str:
    prefix = static_prefix(page)
    body, _ = exporter(prefix).from_notebook_node(
        nb, resources={"metadata": {"name": name}, "static_url": prefix, **resources})
    return body


def _write(out: Path, page: PurePosixPath, text: str) -> Path:
    target = out / page
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    return target


def _repository_path(path: Path) -> PurePosixPath:
    return PurePosixPath(path.relative_to(ROOT).as_posix())


def slides_page(notebook: Path) -> PurePosixPath:
    """Where a notebook's deck lands under the slides folder.

    >>> slides_page(ROOT / "notebooks" / "solutions" / "03_x_solutions.ipynb")
    PurePosixPath('solutions/03_x_solutions.slides.html')
    """
    return PurePosixPath(
        notebook.relative_to(ROOT / "notebooks").with_suffix(".slides.html").as_posix())


def build_slides(out: Path) -> list[Path]:
    """Write a reveal.js deck for every notebook and solutions notebook under out/; return the
    decks.

    Cells present as their `slideshow.slide_type` says (slide, subslide, fragment, skip, notes);
    in a deck, S opens the speaker view with the notes cells. slides.js then makes each slide
    fit (see the module notes). out/index.html lists the decks by title, in course order.
    """
    copy_assets(out, slides=True)
    exporter = _exporters(SlidesExporter, SLIDES_TEMPLATE)
    sources = notebooks() + solutions()
    pages = {_repository_path(source): slides_page(source) for source in sources}
    linked_files: set[PurePosixPath] = set()
    decks, titles = [], {}
    for source in sources:
        document = _repository_path(source)
        nb = slides_apart(static_widgets(_titled(nbformat.read(source, as_version=4)), document,
                                         pictures_at_widget_size=False))
        titles[document] = nb.metadata.get("title", source.stem)
        text = _render(exporter, nb, source.stem, pages[document], cjk_css=CJK_CSS)
        decks.append(_write(out, pages[document],
                            rewrite_links(text, document, pages, linked_files)))
    _copy_linked(out, linked_files)
    _write(out, PurePosixPath("index.html"), slides_index(pages, titles))
    return decks


def slides_index(pages: Pages, titles: dict[PurePosixPath, str]) -> str:
    """The decks' home page: each notebook by its title, in course order, its solutions beside it.

    >>> pages = {PurePosixPath("notebooks/00_a.ipynb"): PurePosixPath("00_a.slides.html"),
    ...          PurePosixPath("notebooks/solutions/00_a_solutions.ipynb"):
    ...              PurePosixPath("solutions/00_a_solutions.slides.html")}
    >>> page = slides_index(pages, {PurePosixPath("notebooks/00_a.ipynb"): "00 · Welcome"})
    >>> ('<a href="00_a.slides.html">00 · Welcome</a>' in page,
    ...  'href="solutions/00_a_solutions.slides.html"' in page)
    (True, True)
    """
    course = sorted(document for document in pages if document.parent.name != "solutions")
    items = []
    for notebook in course:
        title = html.escape(titles.get(notebook, notebook.stem))
        item = f'<li><a href="{html.escape(pages[notebook].as_posix())}">{title}</a>'
        solution = notebook.parent / "solutions" / f"{notebook.stem}_solutions.ipynb"
        if solution in pages:
            link = html.escape(pages[solution].as_posix())
            item += f' <span class="solutions">· <a href="{link}">solutions</a></span>'
        items.append(item + "</li>")
    readme = ROOT / "README.md"
    course_title = _title(readme.read_text(encoding="utf-8")) if readme.exists() else ""
    heading = f"{course_title}: slides" if course_title else "Course slides"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(heading)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; max-width: 46em; margin: 2em auto; padding: 0 1em; \
line-height: 1.5; }}
ul {{ list-style: none; padding-left: 0; }} li {{ margin: 0.5em 0; font-size: 1.1em; }}
.solutions {{ font-size: 0.85em; color: #555; }} .keys {{ color: #444; }}
</style></head>
<body><h1>{html.escape(heading)}</h1>
<p class="keys">Space or &rarr;: next, through every slide (a slide too long for the screen \
continues on
the next one). S: speaker view with notes. F: full screen. Esc: every slide at once.</p>
<ul>
{chr(10).join(items)}
</ul></body></html>
"""


def _title(markdown: str) -> str:
    """The text of the first `# ` heading in markdown, or ''."""
    match = re.search(r"^# +(.+?)\s*$", markdown, re.MULTILINE)
    return match[1].replace("`", "") if match else ""


def _titled(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with metadata.title (the page's <title>) taken from its first heading."""
    first = next((cell.source for cell in nb.cells if cell.cell_type == "markdown"), "")
    if _title(first) and "title" not in nb.metadata:
        nb.metadata["title"] = _title(first)
    return nb


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# What @jupyter-widgets/html-manager renders by itself; any other widget library it would fetch
# from a CDN, which an offline page cannot reach.
STATIC_WIDGET_MODULES = {"@jupyter-widgets/base", "@jupyter-widgets/controls",
                         "@jupyter-widgets/output"}
_NOTE_STYLE = ("margin: 0.3em 0; padding: 0.35em 0.7em; border-left: 4px solid #e0a800; "
               "background: #fff8e1; color: #5d4400; font-size: 0.85em; font-family: sans-serif;")


def _widget_models(model_id: str, state: dict) -> set[str] | None:
    """The models a view needs (it and every model it references), or None if one is missing or
    belongs to a widget library a static page cannot load."""
    needed, todo = set(), [model_id]
    while todo:
        current = todo.pop()
        if current in needed:
            continue
        model = state.get(current)
        if model is None or model.get("model_module") not in STATIC_WIDGET_MODULES:
            return None
        needed.add(current)
        todo += re.findall(r"IPY_MODEL_(\w+)", json.dumps(model.get("state", {})))
    return needed


def _note(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("display_data", data={
        "text/html": f'<p class="course-widget-note" style="{_NOTE_STYLE}">{text}</p>',
        "text/plain": re.sub(r"<[^>]+>", "", html.unescape(text))})


def _picture_of(output: nbformat.NotebookNode, widget_size: bool) -> nbformat.NotebookNode:
    """A widget output as its picture alone (and its text), so no page draws the widget from
    state. With ``widget_size`` the picture is shown at the size the live widget has: every
    ckptlib widget draws it at twice the pixels it takes on screen (``ckptlib.widgets._view``), so,
    unless the output says otherwise, at half its pixel width; at its full pixels a page shows it
    twice too large. A slide wants it as large as the canvas allows (slides.js shrinks what does
    not fit): no width.

    >>> png = "iVBORw0KGgoAAAANSUhEUgAAA8AAAATY"   # the start of a 960 x 1240 PNG
    >>> output = nbformat.v4.new_output("display_data", data={"image/png": png})
    >>> _picture_of(output, widget_size=True).metadata
    {'image/png': {'width': 480}}
    """
    data = {key: output.data[key] for key in ("image/png", "text/plain") if key in output.data}
    metadata = copy.deepcopy(dict(output.get("metadata", {})))
    if widget_size and "image/png" in data and "width" not in metadata.get("image/png", {}):
        header = base64.b64decode(data["image/png"][:32])   # the signature, then IHDR: width
        metadata.setdefault("image/png", {})["width"] = int.from_bytes(header[16:20], "big") // 2
    return nbformat.v4.new_output("display_data", data=data, metadata=metadata)


def where_to_run(document: PurePosixPath) -> str:
    """How a learner runs the notebook ``document`` (``notebooks/...``) live: ``make lab`` opens
    the learner's own copy in ``lab/`` (tools/lab.py: outputs cleared, so predictions are blind),
    never the committed notebook.

    >>> where_to_run(PurePosixPath("notebooks/solutions/05_x_solutions.ipynb"))
    'Run it in JupyterLab: <code>make lab NOTEBOOK=solutions/05_x_solutions.ipynb</code> opens \
your own copy, lab/solutions/05_x_solutions.ipynb.'
    """
    name = html.escape(document.relative_to("notebooks").as_posix())
    return (f"Run it in JupyterLab: <code>make lab NOTEBOOK={name}</code> opens your own copy, "
            f"lab/{name}.")


def static_widgets(nb: nbformat.NotebookNode, document: PurePosixPath,
                   pictures_at_widget_size: bool = True) -> nbformat.NotebookNode:
    """The notebook with its widget outputs made honest for a page without a kernel.

    A widget output with its own picture (``image/png``, taken when its cell showed it) becomes
    that picture, after a note that it is one and where to run it: the saved state is the
    widget's last state, which later cells may have changed. Without a picture, a widget whose
    saved state is complete is shown as the snapshot the state describes, after such a note. A
    widget whose state is missing or incomplete would be an empty box (or, as nbconvert falls
    back, its text repr): it becomes a note naming it.
    The saved state keeps exactly the models the shown widgets need. A picture is shown at the
    widget's size where ``pictures_at_widget_size`` (a page; a deck passes False: see
    ``_picture_of``).

    >>> output = nbformat.v4.new_output(
    ...     "display_data", data={WIDGET_VIEW: {"model_id": "a1"}, "text/plain": "Slider(value=3)"})
    >>> nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=[output])])
    >>> nb = static_widgets(nb, PurePosixPath("notebooks/00_x.ipynb"))
    >>> print(nb.cells[0].outputs[0].data["text/plain"])  # doctest: +NORMALIZE_WHITESPACE
    Interactive widget Slider(value=3): its state was not saved with this page.
    Run it in JupyterLab: make lab NOTEBOOK=00_x.ipynb opens your own copy, lab/00_x.ipynb.
    >>> "widgets" in nb.metadata
    False
    """
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    where = where_to_run(document)
    shown: set[str] = set()
    for cell in nb.cells:
        outputs = []
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(output)
                continue
            picture = output.get("data", {}).get("image/png")
            if picture is not None:
                outputs += [_note("Picture of an interactive widget as its cell showed it: its "
                                  f"controls work in a live notebook only. {where}"),
                            _picture_of(output, pictures_at_widget_size)]
                continue
            models = _widget_models(view.get("model_id", ""), state)
            if models is None:
                name = str(output.data.get("text/plain", "")).strip().splitlines()[0:1]
                label = f" {html.escape(name[0])}" if name else ""
                outputs.append(_note(f"Interactive widget{label}: its state was not saved with "
                                     f"this page. {where}"))
            else:
                shown |= models
                outputs += [_note("Static snapshot of an interactive widget, in the state it was "
                                  "saved with (later cells may have changed it since it was "
                                  f"shown): its controls do nothing here. {where}"),
                            output]
        if "outputs" in cell:
            cell.outputs = outputs
    if shown:
        widgets = nb.metadata.widgets[WIDGET_STATE]
        widgets["state"] = {model_id: model for model_id, model in state.items()
                            if model_id in shown}
    else:
        nb.metadata.pop("widgets", None)
    return nb


def slides_apart(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with each widget output (after static_widgets: a cell with a widget note) in a
    cell of its own right after its code, tagged OUTPUTS_ONLY so the deck shows no code there.

    slides.js splits a slide that is too tall between cells, so the widget lands on a slide of
    its own at full size, instead of being shrunk with its code until its text is ~8 px.

    >>> note = _note("Static snapshot of an interactive widget")
    >>> nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("explorer", outputs=[note])])
    >>> [(cell.source, len(cell.outputs), cell.metadata.get("tags"))
    ...  for cell in slides_apart(nb).cells]
    [('explorer', 0, None), ('', 1, ['course-outputs-only'])]
    """
    cells = []
    for cell in nb.cells:
        cells.append(cell)
        notes = [o for o in cell.get("outputs", [])
                 if "course-widget-note" in str(o.get("data", {}).get("text/html", ""))]
        if not notes:
            continue
        apart = nbformat.v4.new_code_cell("", outputs=cell.outputs,
                                          execution_count=cell.execution_count)
        apart.metadata = {"tags": [OUTPUTS_ONLY], "slideshow": {"slide_type": "-"}}
        cell.outputs = []
        cells.append(apart)
    nb.cells = cells
    return nb


def _markdown_page(text: str) -> nbformat.NotebookNode:
    """A markdown document as a one-cell notebook, so it renders exactly like the notebooks'
    prose."""
    return _titled(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)]))


def _figures_markdown(figures: list[Path]) -> str:
    parts = ["# Figures", "",
             "Every figure is drawn from ckptlib code by `make figures` "
             "(`python -m benchmarks.bench --figures figures`)."]
    for name in sorted({figure.stem for figure in figures}):
        formats = sorted(figure.suffix[1:] for figure in figures if figure.stem == name)
        shown = f"{name}.svg" if "svg" in formats else f"{name}.{formats[0]}"
        links = ", ".join(f"[{fmt}]({name}.{fmt})" for fmt in formats)
        parts += ["", f"## {name}", "", f"![{name}]({shown})", "", f"Files: {links}"]
    return "\n".join(parts) + "\n"


class _PageParser(HTMLParser):
    """Collects ids, (tag, attribute, url) links, headings and inline script text."""

    LINK_ATTRIBUTES = {"href", "src", "xlink:href"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str, str]] = []
        self.headings: list[tuple[int, str, str]] = []
        self.scripts: list[str] = []
        self._heading: list | None = None  # [level, id, text so far] inside a heading
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            elif name in self.LINK_ATTRIBUTES and value is not None:
                self.links.append((tag, name, value))
        if re.fullmatch(r"h[1-6]", tag):
            self._heading = [int(tag[1]), dict(attrs).get("id") or "", ""]
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        if self._heading and tag == f"h{self._heading[0]}":
            level, anchor, text = self._heading
            self.headings.append((level, anchor, text.replace("¶", "").strip()))
            self._heading = None
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._heading:
            self._heading[2] += data
        if self._in_script:
            self.scripts.append(data)


def _parse(text: str) -> _PageParser:
    parser = _PageParser()
    parser.feed(text)
    parser.close()
    return parser


_LINK = re.compile(r'(\b(?:href|src)=")([^"]*)(")')


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as
    hyphens.

    nbconvert keeps the heading's case and punctuation instead, so links written for GitHub
    are translated (see rewrite_links).

    >>> github_anchor("Presenting: live slides and static decks")
    'presenting-live-slides-and-static-decks'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def rewrite_links(text: str, document: PurePosixPath, pages: Pages,
                  linked_files: set[PurePosixPath], headings: Headings | None = None) -> str:
    """Point the relative links in a page rendered from `document` at the pages built from their
    targets.

    A link to another repository file is kept, pointing at out/<its repository path>, and the
    file is added to linked_files for the caller to copy there. With the pages' headings, a
    GitHub-style #anchor becomes the id nbconvert gave that heading.

    >>> pages = {PurePosixPath("README.md"): PurePosixPath("index.html"),
    ...          PurePosixPath("notebooks/03_x.ipynb"): PurePosixPath("notebooks/03_x.html")}
    >>> headings = {PurePosixPath("notebooks/03_x.ipynb"):
    ...                 [(2, "Step-1:-holders", "Step 1: holders")]}
    >>> rewrite_links('<a href="03_x.ipynb#step-1-holders">', PurePosixPath("notebooks/03_x.ipynb"),
    ...               pages, set(), headings)
    '<a href="03_x.html#Step-1:-holders">'
    >>> rewrite_links('<a href="../README.md">', PurePosixPath("notebooks/03_x.ipynb"),
    ...               pages, set())
    '<a href="../index.html">'
    """
    here = pages[document].parent.as_posix() or "."
    anchors = {target: {github_anchor(text): anchor for _, anchor, text in found if anchor}
               for target, found in (headings or {}).items()}

    def rewrite(match: re.Match) -> str:
        url = html.unescape(match[2])
        parts = urlsplit(url)
        if not url or parts.scheme or parts.netloc or url.startswith("/"):
            return match[0]
        target = document
        if parts.path:
            target = PurePosixPath(posixpath.normpath(
                posixpath.join(document.parent.as_posix(), unquote(parts.path))))
        fragment = anchors.get(target, {}).get(parts.fragment, parts.fragment)
        if target in pages:
            new = posixpath.relpath(pages[target].as_posix(), here) if parts.path else ""
        elif not target.as_posix().startswith("..") and (ROOT / target).is_file():
            linked_files.add(target)
            new = posixpath.relpath(target.as_posix(), here)
        else:
            return match[0]  # check_site reports it
        return match[1] + html.escape(new + (f"#{fragment}" if fragment else "")) + match[3]

    return _LINK.sub(rewrite, text)


def _copy_linked(out: Path, linked_files: set[PurePosixPath]) -> None:
    for relative in linked_files:
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, out / relative)


def _course_pages(pages: Pages) -> list[PurePosixPath]:
    """README, then the notebooks in order: the path previous / next links follow."""
    return [PurePosixPath("README.md")] + [d for d in pages if d.parent.as_posix() == "notebooks"]


def _title_of(document: PurePosixPath, headings: Headings) -> str:
    return next((text for level, _, text in headings[document] if level == 1), document.stem)


def _sections(document: PurePosixPath, headings: Headings,
              link: Callable[[PurePosixPath, str], str]) -> str:
    """A list of links to a page's `## ` sections."""
    return "<ul>" + "".join(f'<li><a href="{link(document, anchor)}">{html.escape(text)}</a></li>'
                            for level, anchor, text in headings[document]
                            if level == 2 and anchor) + "</ul>"


def _toc(current: PurePosixPath, pages: Pages, headings: Headings) -> str:
    """The table of contents seen from `current`: every page; sections of this page (all, on the
    home page)."""
    here = pages[current].parent.as_posix() or "."

    def link(document: PurePosixPath, anchor: str = "") -> str:
        return html.escape(posixpath.relpath(pages[document].as_posix(), here)
                           + (f"#{anchor}" if anchor else ""))

    home, *course = _course_pages(pages)
    lines = ['<nav class="course-toc" aria-label="Course contents">',
             f'<p><a href="{link(home)}"><strong>{html.escape(_title_of(home, headings))}'
             '</strong></a></p>', "<ul>"]
    for notebook in course:
        css = ' class="current"' if notebook == current else ""
        lines.append(f'<li{css}><a href="{link(notebook)}">'
                     f'{html.escape(_title_of(notebook, headings))}</a>')
        solution = notebook.parent / "solutions" / f"{notebook.stem}_solutions.ipynb"
        if solution in pages:
            css = "course-solutions current" if solution == current else "course-solutions"
            lines.append(f'<span class="{css}">(<a href="{link(solution)}">solutions</a>)</span>')
        if current in (notebook, home):
            lines.append(_sections(notebook, headings, link))
        lines.append("</li>")
    for extra in (PurePosixPath("docs/instructor.md"), PurePosixPath("figures/index.md")):
        if extra in pages:
            css = ' class="current"' if extra == current else ""
            lines.append(f'<li{css}><a href="{link(extra)}">'
                         f'{html.escape(_title_of(extra, headings))}</a>')
            if extra == current:
                lines.append(_sections(extra, headings, link))
            lines.append("</li>")
    lines.append("</ul></nav>")
    return "\n".join(lines)


def _pager(current: PurePosixPath, pages: Pages, headings: Headings) -> str:
    """Previous / next links along README -> notebook 00 -> ... -> the last notebook."""
    sequence = _course_pages(pages)
    if current not in sequence:
        return ""
    here, index = pages[current].parent.as_posix() or ".", sequence.index(current)

    def link(document: PurePosixPath, label: str) -> str:
        href = html.escape(posixpath.relpath(pages[document].as_posix(), here))
        return f'<a href="{href}">{label.format(html.escape(_title_of(document, headings)))}</a>'

    previous = link(sequence[index - 1], "&larr; {}") if index > 0 else "<span></span>"
    following = (link(sequence[index + 1], "{} &rarr;") if index + 1 < len(sequence)
                 else "<span></span>")
    return f'<nav class="course-pager">{previous}{following}</nav>'


def build_site(out: Path) -> list[Path]:
    """Render README, the notebooks (with their committed outputs), solutions, the instructor guide
    and the figures under out/ as linked, offline HTML; return the pages written."""
    copy_assets(out, slides=False)
    documents = {PurePosixPath("README.md"):
                 _markdown_page((ROOT / "README.md").read_text(encoding="utf-8"))}
    for source in notebooks() + solutions():
        document = _repository_path(source)
        documents[document] = static_widgets(_titled(nbformat.read(source, as_version=4)), document)
    guide = ROOT / "docs" / "instructor.md"
    if guide.exists():
        documents[_repository_path(guide)] = _markdown_page(guide.read_text(encoding="utf-8"))
    figures = sorted(f for f in (ROOT / "figures").glob("*") if f.suffix in (".svg", ".png"))
    if figures:
        documents[PurePosixPath("figures/index.md")] = _markdown_page(_figures_markdown(figures))
    pages = {document: PurePosixPath("index.html") if document.name == "README.md"
             else document.with_suffix(".html")
             for document in documents}

    exporter = _exporters(HTMLExporter, SITE_TEMPLATE)
    rendered = {document: _render(exporter, nb, document.stem, pages[document], site_css=SITE_CSS)
                for document, nb in documents.items()}
    headings = {document: _parse(text).headings for document, text in rendered.items()}
    linked_files: set[PurePosixPath] = set()
    written = []
    for document, text in rendered.items():
        text = rewrite_links(text, document, pages, linked_files, headings)
        text = text.replace(TOC_MARK, _toc(document, pages, headings), 1)
        text = text.replace(PAGER_MARK, _pager(document, pages, headings), 1)
        written.append(_write(out, pages[document], text))
    linked_files.update(_repository_path(figure) for figure in figures)
    _copy_linked(out, linked_files)
    return written


_NETWORK_URL_IN_SCRIPT = re.compile(r"""["'`]((?:https?:)?//[^"'`\s]+)""")


def check_site(out: Path) -> list[str]:
    """Every link or asset in out's HTML that would not work offline, one 'page: problem' line each.

    A relative href/src must name an existing file (and an element id, when it has a #fragment);
    only <a href> may point at the network (a link to read online); nothing may load from it.
    """
    parsed = {page: _parse(page.read_text(encoding="utf-8"))
              for page in sorted(out.rglob("*.html"))}
    problems = []
    for page, info in parsed.items():
        name = page.relative_to(out).as_posix()
        for tag, attribute, url in info.links:
            parts = urlsplit(url)
            if parts.scheme in ("data", "mailto"):
                continue
            if parts.scheme or parts.netloc:
                if (tag, attribute) != ("a", "href"):
                    problems.append(f"{name}: <{tag} {attribute}> loads {url} from the network")
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            # Browsers look the fragment up as written, then percent-decoded (nbconvert's ids keep
            # escapes).
            if not target.is_file():
                problems.append(f"{name}: <{tag} {attribute}={url!r}> names a missing file")
            elif (parts.fragment and target in parsed
                  and not {parts.fragment, unquote(parts.fragment)} & parsed[target].ids):
                problems.append(f"{name}: <{tag} {attribute}={url!r}> names a missing anchor")
        for script in info.scripts:
            problems += [f"{name}: an inline script loads {url} from the network"
                         for url in _NETWORK_URL_IN_SCRIPT.findall(script)]
    return problems


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] not in ("slides", "site", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    command = argv[0]
    out = (Path(argv[1]) if len(argv) == 2
           else ROOT / "build" / ("slides" if command == "slides" else "site"))
    try:
        if command in ("slides", "site"):
            shutil.rmtree(out, ignore_errors=True)
            built = build_slides(out) if command == "slides" else build_site(out)
            print(f"{len(built)} pages in {out}/: open {out / 'index.html'}")
    except AssetsUnavailable as error:
        print(error, file=sys.stderr)
        return 1
    problems = check_site(out)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
