"""Choose what a selective checkpoint keeps: tick the ops of a Transformer block, see what it costs.

Design notes
============

The rows. One forward of the block runs under a dispatch mode that notes every op a
selective checkpoint could keep: not views, not in-place ops, not ops whose output
shares an input's memory (``ckptlib.selective_checkpoint`` never caches those). Calls
are grouped by *signature*, the op and the shapes of its tensor inputs, the unit the cost
policy of :func:`ckptlib.policy_from_costs` chooses in (the two residual adds of a block
are one row with two calls). A row's bytes are its outputs' bytes; its time is the median
of a few timed forwards.

A selection is a policy. Ticked rows become ``policy(op, *args) -> bool``: keep the output
of a call whose signature is ticked. It runs through ``selective_checkpoint`` around the
block, beside three references: plain autograd (no checkpoint), full checkpointing
(``ckptlib.checkpoint``), and the two ready-made choices, ``save_matmuls`` and the cost
policy (``policy_from_costs(block, x, memory_ratio=0.5)``: a budget of half the activation
bytes its profile counts; on the default block that profile counts more than the meter sees
plain autograd keep, so the policy may keep more than half of what full checkpointing drops).

What is shown, and what can be trusted. *Kept bytes* are exact: the live-tensor meter
around the forward, minus the block's output (alive in every variant). *Calls rerun*
counts the calls of the table's ops the meter sees in the recomputation phase (a replayed
op is not run, and ops that only fed kept outputs are skipped). *Rerun FLOPs* are the
matmul FLOPs of a forward+backward step (torch's ``FlopCounterMode``) minus plain
autograd's: the multiply-adds the recomputation repeats. All three are deterministic, so
they are what a tick updates and what the plot draws.

Time, only on request. A step time measured once, when the explorer was built, and compared
with the selection's measured later compares two moments of a shared machine: it once showed
full checkpointing faster than plain. So nothing is timed until "time all five" is pressed;
then the five variants are timed together, in turns (:mod:`ckptlib.widgets._timing`), and
each is shown with its spread, its ratio to plain marked "within noise" where the spreads
overlap or a checkpoint came out faster. Ticking anything clears those times. The per-op
times in the table are from the build (the cost policy chooses by them), so the cost
policy's choice may differ from machine to machine.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ckptlib import checkpoint, policy_from_costs, save_matmuls, selective_checkpoint
from ckptlib.memory import MemoryMeter, format_bytes
from ckptlib.models import TinyTransformer
from ckptlib.selective.ops import tensors_of as _tensors
from ckptlib import palette
from ckptlib.core.checks import storage_ptr, storage_ptrs
from ckptlib.core.errors import dims_text
from ckptlib.widgets._timing import compare, interleaved, spread
from ckptlib.widgets._view import WidgetView, png_bytes

__all__ = ["PolicyExplorer"]

# The table's box on a narrow page (it scrolls inside): about seven rows, so that the buttons, the
# table, the summary and the plot below it fit in one JupyterLab screen at 1100 x 800 (the browser
# test measures it), timed or not.
TABLE_HEIGHT = "230px"

Signature = tuple[Any, tuple[tuple[int, ...], ...]]   # (aten op overload, input shapes)
# Inline, so that a page's own ``code`` style (a slide deck's larger type) does not apply.
_MONOSPACE = "font-family:var(--jp-code-font-family, monospace); font-size:90%"
# "time all five": rounds of one step of each variant, after a warm-up of each
TIMED_ROUNDS = 7
SELECTION = "your selection"
# drawn at 2x; 10 pt is 11 px on screen; 432 x 184 px: five bars, and the note beside it at 1100 px
FIGURE_INCHES, SCREEN_DPI, DRAW_SCALE, FONT_PT = (5.4, 2.3), 80, 2, 10


def signature(op: Any, args: tuple) -> Signature:
    """What a row stands for: the op and the shapes of its positional tensor inputs (as
    ``OpCall``)."""
    return op, tuple(tuple(t.shape) for t in _tensors(args))


class _OpRows(TorchDispatchMode):
    """Notes each call a selective checkpoint could keep: signature, output bytes, seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Signature, int, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed_s = time.perf_counter() - start
        outputs = _tensors(out)
        inputs = storage_ptrs(_tensors((args, tuple((kwargs or {}).values()))))
        if not (func.is_view or func._schema.is_mutable or not outputs
                or any(storage_ptr(t) in inputs for t in outputs)):
            self.calls.append((signature(func, args),
                               sum(t.numel() * t.element_size() for t in outputs),
                               elapsed_s))
        return out


def _op_rows(block: torch.nn.Module, x: torch.Tensor, repeats: int = 3) -> list[dict[str, Any]]:
    runs = []
    for _ in range(1 + repeats):     # the first run warms up
        with torch.enable_grad(), _OpRows() as recorder:
            block(x)
        runs.append(recorder.calls)
    rows: dict[Signature, dict[str, Any]] = {}
    for position, (call, nbytes, _) in enumerate(runs[0]):
        row = rows.setdefault(call, {"signature": call, "op": call[0].__name__.split(".")[0],
                                     "input_shapes": call[1], "calls": 0, "output_bytes": 0,
                                     "time_s": 0.0})
        row["calls"] += 1
        row["output_bytes"] += nbytes
        row["time_s"] += statistics.median(run[position][2] for run in runs[1:])
    return list(rows.values())


class PolicyExplorer(WidgetView):
    """Tick the ops of a Transformer block whose outputs a selective checkpoint keeps.

    Args:
        model: a ``TinyTransformer``; its first block is explored on a random input of
            ``batch x seq x d_model``. Default: ``TinyTransformer(depth=1, d_model=64,
            heads=4, seq=32)``.
        batch: the input's batch size.

    Attributes:
        rows: one dict per op signature, in forward order (the table's ``#`` column is the
            index in this list): ``"op"``, ``"input_shapes"``,
            ``"calls"``, ``"output_bytes"``, ``"time_s"`` (forward time of its calls, at build),
            ``"save_matmuls"`` and ``"cost_policy"`` (does that policy keep it?).
        checkboxes: one ``Checkbox`` per row: ticked means kept.
        table: the ``GridBox`` of rows: number, checkbox, op, shapes, calls, bytes, time, and
            whether each ready-made policy keeps it.
        result: the current selection measured (all exact): ``"kept_bytes"``, ``"rerun_ops"``
            (calls of the table's ops the rerun computed), ``"rerun_flops"`` (matmul FLOPs of a
            step beyond plain autograd's), ``"kept_rows"`` (indices of the ticked rows).
        references: the same numbers for ``"plain"``, ``"full checkpoint"``,
            ``"save_matmuls"`` and ``"cost policy"``.
        timing: empty until :meth:`time_all` (the "time all five" button); then variant name ->
            the seconds of its :data:`TIMED_ROUNDS` steps, all five timed in turns. A tick clears
            it.
        timer: ``timer(name, step) -> seconds`` of one call of ``step`` (a forward+backward of
            the variant ``name``); a test replaces it with a clock it controls.
        summary, plot, note: the five variants' numbers as a table and as bars, and what the
            numbers are (which are exact; how the steps were timed).
        tick_matmuls, tick_cost, clear, time_button: buttons.

    >>> model = TinyTransformer(depth=1, d_model=16, heads=2, seq=8, vocab=20)
    >>> explorer = PolicyExplorer(model, batch=2)
    >>> explorer.references["full checkpoint"]["kept_bytes"], explorer.result["kept_bytes"]
    (0, 0)
    >>> softmax = next(i for i, row in enumerate(explorer.rows) if row["op"] == "_softmax")
    >>> explorer.checkboxes[softmax].value = True      # keep the attention weights
    >>> explorer.result["kept_bytes"] == explorer.rows[softmax]["output_bytes"] == 2 * 2 * 8 * 8 * 4
    True
    """

    def __init__(self, model: TinyTransformer | None = None, *, batch: int = 4) -> None:
        if model is None:
            model = TinyTransformer(depth=1, d_model=64, heads=4, seq=32, vocab=64)
        blocks = getattr(model, "blocks", None)
        if not isinstance(model, torch.nn.Module) or not blocks or not hasattr(blocks[0], "attn"):
            raise TypeError("PolicyExplorer needs a TinyTransformer (its first block is "
                            f"explored), got {type(model).__name__}.")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}.")
        self.block = blocks[0]
        d_model = self.block.ln1.normalized_shape[0]
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, model.seq, d_model, generator=generator).requires_grad_()
        self.rows = _op_rows(self.block, self.x)
        self._op_names = {row["op"] for row in self.rows}
        cost = policy_from_costs(self.block, self.x, memory_ratio=0.5)
        chosen = {(call.op, call.input_shapes) for call in cost.chosen}
        for row in self.rows:
            row["save_matmuls"] = row["signature"][0] in save_matmuls
            row["cost_policy"] = row["signature"] in chosen
        self._forwards: dict[str, Callable[[], torch.Tensor]] = {
            "plain": lambda: self.block(self.x),
            "full checkpoint": lambda: checkpoint(self.block, self.x),
            "save_matmuls": lambda: selective_checkpoint(self.block, self.x, policy=save_matmuls),
            "cost policy": lambda: selective_checkpoint(self.block, self.x, policy=cost),
        }
        self._plain_flops = self._step_flops(self._forwards["plain"])
        self.references = {name: self._measure(forward) for name, forward in self._forwards.items()}
        self.result: dict[str, Any] = {}
        self.timing: dict[str, list[float]] = {}
        self.timer: Callable[[str, Callable[[], None]], float] = _time_one_step
        self._holding = False

        self.checkboxes = [widgets.Checkbox(value=False, indent=False,
                                            layout=widgets.Layout(width="24px"))
                           for _ in self.rows]
        for box in self.checkboxes:
            box.observe(lambda _change: self._changed(), names="value")
            box.add_class("ckptlib-policy-tick")
        self.tick_matmuls = widgets.Button(description="tick save_matmuls",
                                           layout=widgets.Layout(width="auto"))
        self.tick_cost = widgets.Button(description="tick the cost policy",
                                        layout=widgets.Layout(width="auto"))
        self.clear = widgets.Button(description="clear", layout=widgets.Layout(width="auto"))
        self.time_button = widgets.Button(description="time all five", icon="clock-o",
                                          tooltip=f"{TIMED_ROUNDS} steps of each variant, in turns",
                                          layout=widgets.Layout(width="auto"))
        self.tick_matmuls.on_click(lambda _button: self.select(lambda row: row["save_matmuls"]))
        self.tick_cost.on_click(lambda _button: self.select(lambda row: row["cost_policy"]))
        self.clear.on_click(lambda _button: self.select(lambda row: False))
        self.time_button.on_click(lambda _button: self.time_all())
        self.summary = widgets.HTML(layout=widgets.Layout(max_width="100%"))
        self.note = widgets.HTML(layout=widgets.Layout(flex="1 1 200px", max_width="520px",
                                                       margin="0 0 0 12px"))
        self.plot = widgets.Image(format="png", layout=widgets.Layout(
            width=f"{round(FIGURE_INCHES[0] * SCREEN_DPI)}px", max_width="100%", height="auto"))
        for name, widget in (("summary", self.summary), ("plot", self.plot), ("note", self.note),
                             ("tick-matmuls", self.tick_matmuls),
                             ("clear", self.clear), ("time", self.time_button)):
            widget.add_class(f"ckptlib-policy-{name}")  # stable handles for the browser test
        self.table = self._table()
        wrap = dict(flex_flow="row wrap", align_items="flex-start", max_width="100%")
        # The table, then what the selection costs: side by side where they fit (a wide screen, a
        # slide), one under the other where they do not (a laptop with JupyterLab's side panel).
        # There the table scrolls inside a box of TABLE_HEIGHT and the note sits beside the plot,
        # so that a tick and the summary and plot it changes are on one screen.
        self.widget = widgets.VBox([
            widgets.Box([self.tick_matmuls, self.tick_cost, self.clear, self.time_button],
                        layout=widgets.Layout(**wrap)),
            widgets.Box([widgets.Box([self.table], layout=widgets.Layout(
                max_height=TABLE_HEIGHT, overflow_y="auto", margin="0 20px 8px 0",
                max_width="100%")),
                widgets.VBox([self.summary,
                              widgets.Box([self.plot, self.note], layout=widgets.Layout(**wrap))],
                             layout=widgets.Layout(max_width="100%"))],
                        layout=widgets.Layout(**wrap)),
        ], layout=widgets.Layout(max_width="100%"))
        self.widget.add_class("ckptlib-policy-explorer")
        self._figure = Figure(figsize=FIGURE_INCHES, dpi=SCREEN_DPI * DRAW_SCALE)
        self.update()

    def _text(self) -> str:
        return (f"PolicyExplorer({len(self.rows)} op signatures, "
                f"{len(self.result['kept_rows'])} kept)")

    # -- measuring ----------------------------------------------------------------
    def _step_flops(self, forward: Callable[[], torch.Tensor]) -> int:
        with FlopCounterMode(display=False) as counter:
            forward().sum().backward()
        self._zero_grads()
        return counter.get_total_flops()

    def _zero_grads(self) -> None:
        self.x.grad = None
        for parameter in self.block.parameters():
            parameter.grad = None

    def _measure(self, forward: Callable[[], torch.Tensor]) -> dict[str, Any]:
        """Kept bytes, calls rerun and rerun FLOPs of one step: exact, so measured once."""
        with MemoryMeter() as meter:
            out = forward()
            kept_bytes = meter.live_bytes - out.untyped_storage().nbytes()
            out.sum().backward()
            del out
        self._zero_grads()
        # Replayed and skipped calls still show up as an op (a detach, an empty meta tensor):
        # count the recomputed calls of the table's ops only.
        rerun_ops = sum(entry.phase == "recompute" and entry.op in self._op_names
                        for entry in meter.timeline)
        return {"kept_bytes": kept_bytes, "rerun_ops": rerun_ops,
                "rerun_flops": self._step_flops(forward) - self._plain_flops}

    def time_all(self) -> dict[str, list[float]]:
        """Time a step of all five variants, in turns, :data:`TIMED_ROUNDS` each after a warm-up;
        show each median with its spread. Returns (and keeps in ``timing``) the seconds."""
        policy = self.policy()
        forwards = {**self._forwards,
                    SELECTION: lambda: selective_checkpoint(self.block, self.x, policy=policy)}

        def run(name: str) -> Callable[[], float]:
            def step() -> None:
                forwards[name]().sum().backward()
            return lambda: self.timer(name, step)

        buttons = (self.time_button, self.tick_matmuls, self.tick_cost, self.clear,
                   *self.checkboxes)
        for button in buttons:          # busy: nothing may change the selection while it is timed
            button.disabled = True
        self.time_button.description = "timing..."
        try:
            self.timing = interleaved({name: run(name) for name in forwards}, TIMED_ROUNDS)
        finally:
            self._zero_grads()
            for button in buttons:
                button.disabled = False
            self.time_button.description = "time all five"
        self._show_summary()
        return self.timing

    def policy(self) -> Callable[..., bool]:
        """The ticked rows as a policy for ``selective_checkpoint``."""
        kept = frozenset(row["signature"]
                         for row, box in zip(self.rows, self.checkboxes) if box.value)
        return lambda op, *args, **kwargs: signature(op, args) in kept

    def select(self, keep: Callable[[dict[str, Any]], bool]) -> None:
        """Tick exactly the rows ``keep(row)`` is true for, then measure once."""
        self._holding = True
        try:
            for row, box in zip(self.rows, self.checkboxes):
                box.value = keep(row)
        finally:
            self._holding = False
        self.update()

    def _changed(self) -> None:
        if not self._holding:
            self.update()

    def update(self) -> None:
        """Measure the ticked selection and redraw (called on every tick); times taken before are
        cleared."""
        kept_rows = [i for i, box in enumerate(self.checkboxes) if box.value]
        policy = self.policy()
        self.result = {
            **self._measure(lambda: selective_checkpoint(self.block, self.x, policy=policy)),
            "kept_rows": kept_rows}
        self.timing = {}
        self._show_summary()
        self._draw()
        self.plot.value = png_bytes(self._figure)

    # -- showing ------------------------------------------------------------------
    def _table(self) -> widgets.GridBox:
        # The "#" column is the row's index in ``rows``, the number ``result["kept_rows"]`` lists:
        # a notebook can name a selection (two rows share the op ``addmm``) the way the table shows
        # it.
        header = ["#", "keep", "op", "input shapes", "calls", "output", "time", "save_<br>matmuls",
                  "cost<br>policy"]
        cells: list[widgets.Widget] = [
            widgets.HTML(f"<b style='display:inline-block; line-height:1.25'>{title}</b>")
            for title in header]
        for number, (row, box) in enumerate(zip(self.rows, self.checkboxes)):
            # Shapes wrap between one another (never inside one): the widest column stays narrow.
            shapes = ", ".join(
                f"<span style='white-space:nowrap'>{dims_text(shape)}</span>"
                for shape in row["input_shapes"])
            cells += [widgets.HTML(str(number)), box,
                      widgets.HTML(f"<span style='{_MONOSPACE}'>{row['op']}</span>"),
                      widgets.HTML("<span style='display:inline-block; white-space:normal; "
                                   "line-height:1.25'>"
                                   f"{shapes}</span>"),
                      widgets.HTML(str(row["calls"])),
                      widgets.HTML(format_bytes(row["output_bytes"])),
                      widgets.HTML(f"{row['time_s'] * 1e6:.0f} µs"),
                      widgets.HTML("✓" if row["save_matmuls"] else ""),
                      widgets.HTML("✓" if row["cost_policy"] else "")]
        for position, cell in enumerate(cells):
            cell.layout.width = "auto" if position % 9 == 3 else "max-content"
            cell.layout.margin = "0"   # compact rows: more of the table in its box
        # Columns as wide as their widest cell, whatever the font (a slide deck's larger type must
        # not run one column into the next); the shapes column wraps past 150 px instead.
        return widgets.GridBox(cells, layout=widgets.Layout(
            grid_template_columns=(
                "repeat(3, max-content) fit-content(190px) repeat(5, max-content)"),
            grid_gap="0 10px", align_items="center", max_width="100%"))

    def _variants(self) -> dict[str, dict[str, Any]]:
        return {**self.references, SELECTION: self.result}

    def _summary(self) -> str:
        cell = "style='padding:2px 6px; text-align:right; white-space:nowrap'"
        head = "style='padding:2px 6px; text-align:right; vertical-align:bottom; line-height:1.2'"
        # Headers break at their spaces ("full / checkpoint"): the summary fits beside the table.
        rows = ["<tr><td></td>"
                + "".join(f"<td {head}><b>{name.replace(' ', '<br>')}</b></td>"
                          for name in self._variants())
                + "</tr>"]
        lines = [("kept for backward", lambda name, v: format_bytes(v["kept_bytes"])),
                 ("calls rerun", lambda name, v: str(v["rerun_ops"])),
                 ("rerun FLOPs", lambda name, v: f"{v['rerun_flops'] / 1e6:+.2f} M")]
        if self.timing:
            lines += [("step time", lambda name, v: self._step_time(name)),
                      ("vs plain",
                       lambda name, v: "" if name == "plain" else self._versus_plain(name))]
        for label, show in lines:
            rows.append(f"<tr><td {cell}>{label}</td>" + "".join(
                f"<td {cell}>{show(name, variant)}</td>"
                for name, variant in self._variants().items()) + "</tr>")
        # Rows as tall as their text (a widget's HTML has the 28 px line of a button): the
        # summary and the plot under it stay on the table's screen.
        return ("<table style='border-collapse:collapse; line-height:1.3'>" + "".join(rows)
                + "</table>")

    def _note(self) -> str:
        """What the numbers are: which are exact, and how (and whether) the steps were timed."""
        timed = (f"Step times: {TIMED_ROUNDS} steps of each variant, timed in turns (median, "
                 "and under it the lowest-highest in ms); \"within noise\" where the spreads "
                 "overlap or a checkpoint comes out faster than plain." if self.timing else
                 "Step times jitter, so a tick does not time them. Press <b>time all five</b> to "
                 "time the five variants together, in turns.")
        return ("<div style='line-height:1.3; font-size:0.92em'>"
                "Kept bytes, calls rerun and rerun FLOPs (matmul FLOPs beyond plain's) are exact. "
                "The cost policy chooses by the op times measured at build, so its column can "
                f"change from one build (or machine) to the next. {timed}</div>")

    def _show_summary(self) -> None:
        self.summary.value = self._summary()
        self.note.value = self._note()

    def _step_time(self, name: str) -> str:
        """``'20.1 ms<br>15.2-33.0'``: the median over its spread, two short lines for a narrow
        column."""
        low, high = spread(self.timing[name])
        return (f"{statistics.median(self.timing[name]) * 1e3:.1f} ms<br>"
                f"{low * 1e3:.1f}-{high * 1e3:.1f}")

    def _versus_plain(self, name: str) -> str:
        """``'1.32x'``, or ``'0.98x<br>within noise'``: a checkpoint never reads faster than plain
        alone."""
        versus = compare(self.timing[name], self.timing["plain"])
        return f"{versus['ratio']:.2f}x" + ("<br><i>within noise</i>" if versus["within_noise"]
                                            else "")

    def _draw(self) -> None:
        self._figure.clear()
        kept_axes, flops_axes = self._figure.subplots(
            1, 2, sharey=True,
            gridspec_kw=dict(left=0.23, right=0.97, bottom=0.25, top=0.87, wspace=0.15))
        names = list(self._variants())
        colours = [palette.HIGHLIGHT if name == SELECTION else palette.MUTED for name in names]
        kept = [variant["kept_bytes"] / 1024 for variant in self._variants().values()]
        flops = [variant["rerun_flops"] / 1e6 for variant in self._variants().values()]
        kept_axes.bar_label(kept_axes.barh(names, kept, color=colours), fmt="%.0f",
                            fontsize=FONT_PT, padding=2)
        flops_axes.bar_label(flops_axes.barh(names, flops, color=colours), fmt="%.1f",
                             fontsize=FONT_PT, padding=2)
        kept_axes.set(xlabel="KiB kept for backward", title="Memory")
        flops_axes.set(xlabel="MFLOP recomputed (matmuls)", title="Recompute")
        kept_axes.invert_yaxis()
        for axes, values in ((kept_axes, kept), (flops_axes, flops)):
            axes.tick_params(labelsize=FONT_PT)
            axes.xaxis.label.set_fontsize(FONT_PT)
            axes.title.set_fontsize(FONT_PT + 1)
            axes.set_xlim(0, max(max(values), 1e-9) * 1.35)


def _time_one_step(name: str, step: Callable[[], None]) -> float:
    """Seconds of one ``step()`` (``name`` says which variant; the real clock does not need it)."""
    began = time.perf_counter()
    step()
    return time.perf_counter() - began
