"""What the memory dashboard says: a step's readout beside checkpointing off, why a step did
not fit and what to change, why a schedule is refused; and the HTML boxes they are shown in.

Every function takes the records and settings it speaks of (dicts, as ``MemoryDashboard``
keeps them in ``history`` and ``failures``) and returns plain text; :func:`message_html` and
:func:`readout_html` escape it into the widget's boxes. Bytes are in MiB throughout, the
plot's unit.
"""

from __future__ import annotations

import html
from typing import Any

import torch

from ckptlib import palette
from ckptlib.widgets._dashboard_models import OFF, OverLimit, in_mib
from ckptlib.widgets._dashboard_plot import FIGURE_PX
from ckptlib.widgets._timing import ratio_text, times_text


def settings_label(settings: dict[str, Any]) -> str:
    """``"per block, depth 4, batch 8"``: a setting as the readout, plot and messages name it."""
    schedule = "checkpointing off" if settings["schedule"] == OFF else settings["schedule"]
    return f"{schedule}, depth {settings['depth']}, batch {settings['batch']}"


def readout(step: int, record: dict[str, Any], reference: dict[str, Any] | None) -> str:
    """Step number ``step``'s ``record``, beside ``reference``: the latest outcome with
    checkpointing off at its depth and batch (a record, a failure, or ``None``)."""
    text = (
        f"step {step} · {settings_label(record)}: "
        f"peak {in_mib(record['peak_bytes'])}, {times_text(record['step_times_s'])}"
    )
    if record["checkpointing"] and reference is not None and "peak_bytes" in reference:
        saving = 1 - record["peak_bytes"] / reference["peak_bytes"]
        text += f" | vs off: {in_mib(reference['peak_bytes'])}, {saving:.0%} less memory"
        if record["off_times_s"] is not None:
            text += (
                f", {ratio_text(record['step_times_s'], record['off_times_s'], 'off')} "
                f"(off timed in turns with it: {times_text(record['off_times_s'])})"
            )
    elif record["checkpointing"] and reference is not None:
        text += (
            f" | vs off: off did not fit (stopped at {in_mib(reference['stopped_bytes'])}, "
            f"limit {in_mib(reference['limit_bytes'], 0)}); this fits"
        )
    elif record["checkpointing"]:
        text += " | run once with checkpointing off to compare"
    return text


def did_not_fit(failure: dict[str, Any]) -> str:
    """The readout of a step stopped at the memory limit."""
    return (
        f"{settings_label(failure)}: did not fit, stopped at {in_mib(failure['stopped_bytes'])}, "
        f"above the {in_mib(failure['limit_bytes'], 0)} limit"
    )


def advice(settings: dict[str, Any], fewest: str | None, fewest_slots: int | None) -> str:
    """What to change when a step does not fit: depends on what is already on. ``fewest``: the
    menu's schedule that keeps the fewest block inputs (at most ``fewest_slots``), if offered."""
    if not settings["checkpointing"]:
        return "Turn checkpointing on, or lower the batch or the depth."
    if settings["schedule"] == fewest or fewest is None:
        return (
            f"Checkpointing is already on ({settings['schedule']}) and keeps the fewest "
            "block inputs of the menu: lower the batch or the depth."
        )
    return (
        f"Checkpointing is already on ({settings['schedule']}): pick {fewest}, which keeps "
        f"at most {fewest_slots} block inputs and recomputes more, or lower the batch or the "
        "depth."
    )


def explanation(
    error: BaseException, settings: dict[str, Any], limit_bytes: float, what_to_do: str
) -> str:
    """Why a step ended: over the limit, out of device memory, or an error of the step."""
    where = settings_label(settings)
    if isinstance(error, OverLimit):
        return (
            f"Does not fit ({where}): {error}, above the {in_mib(limit_bytes, 0)} limit. "
            f"{what_to_do}"
        )
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return f"Out of device memory ({where}). {what_to_do}"
    lines = str(error).strip().splitlines()
    return f"The step failed ({where}): {type(error).__name__}: {lines[0] if lines else ''}"


def not_implemented(model_name: str, schedule: str, why: str, runs: list[str]) -> str:
    """Why ``schedule`` was refused for a learner's model that ``runs`` only those schedules."""
    return (
        f"{model_name} does not implement the schedule {schedule!r}: {why}. Its step would "
        'be plain autograd and read as "0% less memory", so nothing was recorded. Pick a '
        f"schedule it runs ({', '.join(runs) or 'none'}), or make its checkpointing switch "
        "implement this one (ckptlib.models.run_blocks shows how)."
    )


def message_html(text: str) -> str:
    """A message box that wraps ("" for no message)."""
    return (
        ""
        if not text
        else (
            "<div style='white-space:normal; max-width:780px; padding:6px 10px; line-height:1.35; "
            f"border-left:4px solid {palette.LIMIT}; background:#FDECEA; color:#611A15'>"
            f"{html.escape(text)}</div>"
        )
    )


# The readout's box: three lines of its text (14 px at 1.35), its longest at the plot's width.
READOUT_HEIGHT = "60px"
def readout_html(text: str) -> str:
    """The readout's box: wraps below the plot, at most the plot's width."""
    return (
        "<div style='white-space:normal; overflow-wrap:anywhere; line-height:1.35; "
        f"max-width:{FIGURE_PX}px'>{html.escape(text)}</div>"
    )
