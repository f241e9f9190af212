"""Progress of a long run on stderr, whether or not stderr is a terminal.

On a terminal a one-line bar is redrawn in place at most ten times a second; anywhere else (a log
file, a pipe, CI) a plain line is written every ``every_s`` seconds, so a run that takes a while is
never silent for long and a log does not fill with redraws.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

#: Seconds between two progress lines when stderr is not a terminal.
EVERY_S = 5.0


class Progress:
    """``label``'s progress towards ``total`` ``unit``; ``enabled=False`` writes nothing."""

    def __init__(
        self, label: str, total: int, unit: str = "requests", enabled: bool = True,
        every_s: float = EVERY_S, stream: Optional[TextIO] = None,
    ) -> None:  # fmt: skip
        self.label, self.total, self.unit, self.enabled, self.every_s = label, total, unit, enabled, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.last = time.perf_counter()
        self.drawn = False

    def update(self, done: int, detail: str = "", force: bool = False) -> None:
        """``done`` of ``total`` so far; ``detail`` is added to the line (e.g. ``"step 12"``)."""
        now = time.perf_counter()
        interval = 0.1 if self.tty else self.every_s
        if not self.enabled or (not force and now - self.last < interval):
            return
        self.last = now
        tail = f"{done}/{self.total} {self.unit}" + (f", {detail}" if detail else "") + f", {now - self.start:.1f} s"
        if self.tty:
            width = 30
            filled = width * min(done, self.total) // max(self.total, 1)
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {tail}")
            self.drawn = True
        else:
            self.stream.write(f"{self.label}: {tail}\n")
        self.stream.flush()

    def close(self, done: int, detail: str = "") -> None:
        """The last update (on a terminal, the bar's final state and its newline)."""
        if self.enabled and self.tty:
            self.update(done, detail, force=True)
            self.stream.write("\n")
            self.stream.flush()
