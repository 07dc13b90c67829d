"""A command's progress on stderr, for the data commands (`prep`, `tokenizer`, `tokenize`).

On a terminal: one line rewritten in place (carriage return, then erase to the end of the line), cut to the
terminal's width so that it never wraps (a wrapped line cannot be rewritten), redrawn at most 10 times a second.
Anywhere else (a log file, a pipe, a SLURM job's output): a plain line when the task starts, then one every
`every_s` seconds at most, and the last one: a log of a day-long prep gets a few thousand lines, a small one two.

Each line: `prep  45.0%  read 5/12 files, 4.1 of 10.3 MB  12s, about 15s left`. The time left is the rate so far
(elapsed / fraction done) applied to the rest; none before 1 %, where one slow first file would make it a guess.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

from appliance.monitor.headless import fmt_duration

# Plain lines at most this often off a terminal (tokenize printed one every 10 s before this module existed).
PLAIN_EVERY_S = 10.0
TTY_EVERY_S = 0.1
ERASE_TO_END = "\x1b[K"
ETA_FROM = 0.01  # the share done before a time left is given


class ProgressLine:
    """`progress(fraction, message)` for a task; `close()` once it ends (a terminal's line is then finished with a
    newline). Usable as a context manager."""

    def __init__(
        self,
        label: str,
        stream: TextIO | None = None,
        *,
        every_s: float = PLAIN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.stream, self.clock = label, stream if stream is not None else sys.stderr, clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = TTY_EVERY_S if self.tty else every_s
        self.started = clock()
        self._shown_at: float | None = None
        self._drawn = False  # a terminal line is on screen, waiting for its newline
        self._last = ""

    def __call__(self, fraction: float, message: str = "") -> None:
        now = self.clock()
        fraction = min(max(fraction, 0.0), 1.0)
        due = self._shown_at is None or now - self._shown_at >= self.every_s or fraction >= 1.0
        if not due:
            return
        line = self.line(fraction, message, now - self.started)
        if fraction >= 1.0 and line == self._last:
            return  # the last line was already the finished one
        self._shown_at, self._last = now, line
        if self.tty:
            width = shutil.get_terminal_size().columns
            self.stream.write(f"\r{line[: max(width - 1, 1)]}{ERASE_TO_END}")
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def line(self, fraction: float, message: str, elapsed: float) -> str:
        left = ""
        if ETA_FROM <= fraction < 1.0:
            left = f", about {fmt_duration(elapsed * (1.0 - fraction) / fraction)} left"
        detail = f"  {message}" if message else ""
        return f"{self.label} {fraction:6.1%}{detail}  ({fmt_duration(elapsed)}{left})"

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
