"""A text progress bar for a run that takes minutes: one redrawn line on a terminal, a line per
10% in a log."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_bar(
    done: int, total: int, label: str = "", width: int = 24, elapsed_s: float | None = None
) -> str:
    """One line of a text progress bar.

    >>> format_bar(3, 12, "blocks: torch", width=8, elapsed_s=65)
    '[##------]  25%  3/12 01:05 blocks: torch'
    """
    fraction = min(max(done / total, 0.0), 1.0) if total > 0 else 1.0
    filled = int(round(fraction * width))
    line = (f"[{'#' * filled}{'-' * (width - filled)}] {fraction * 100:3.0f}% "
            f"{done:>{len(str(total))}}/{total}")
    if elapsed_s is not None:
        minutes, seconds = divmod(int(elapsed_s), 60)
        line += f" {minutes:02d}:{seconds:02d}"
    return f"{line} {label}".rstrip()


class ProgressBar:
    """A text progress bar on a stream (stderr by default).

    On a terminal it redraws one line; elsewhere (a CI log, a pipe) it writes a
    line every 10% so the log stays short.

    >>> import io
    >>> stream = io.StringIO()
    >>> bar = ProgressBar(4, stream=stream, width=4)
    >>> for _ in range(4):
    ...     bar.advance("step")
    >>> bar.close()
    >>> stream.getvalue().splitlines()[-1].startswith("[####] 100% 4/4")
    True
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.width, self.done = total, width, 0
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.perf_counter()
        self.last_decile = -1

    def advance(self, label: str = "", steps: int = 1) -> None:
        self.done = min(self.done + steps, self.total)
        line = format_bar(
            self.done, self.total, label, self.width, time.perf_counter() - self.started
        )
        if self.interactive:
            self.stream.write("\r" + line.ljust(100)[:100])
        else:
            decile = 10 * self.done // max(self.total, 1)
            if decile == self.last_decile:
                return
            self.last_decile = decile
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


class Ticker:
    """The bar, or nothing: lets the measuring code call ``tick`` unconditionally."""

    def __init__(self, bar: ProgressBar | None) -> None:
        self.bar = bar

    def tick(self, label: str) -> None:
        if self.bar is not None:
            self.bar.advance(label)
