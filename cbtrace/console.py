"""What a long command tells the user while it runs, on stderr: progress and one-line notes.

On a terminal, progress is a ``rich`` bar; elsewhere (CI logs, a pipe, a notebook's captured
stderr) a plain line every ``LINE_EVERY_S``, so a slow replay is never silent. Kineto prints
``USDT: ... profiler_start`` / ``STAGE: ...`` lines from C++ each time a profiler starts or stops
(158 of them in the CPU demo): ``quiet_kineto`` keeps them, and only them, off the terminal.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time

from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

LINE_EVERY_S = 5.0
_KINETO = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] "
                     # CPU memory profiling saw a block freed that it never saw allocated:
                     # expected (replay's peak counts from the profiler's start), not the user's
                     rb"|^\[W\d+ \S+ CPUAllocator\.cpp:\d+\] Memory block of unknown size ")


def announce(message: str) -> None:
    """One line to stderr (e.g. a first-run calibration)."""
    sys.stderr.write(f"cbtrace: {message}\n")
    sys.stderr.flush()


class Progress:
    """``advance(name)`` after each finished item; ``close()`` at the end."""

    def __init__(self, label: str, total: int, done: int = 0, *, show: bool | None = None):
        self.label, self.total, self.n = label, total, done
        self.t0 = self._last = time.monotonic()
        tty = sys.stderr.isatty()
        self.show = (show if show is not None else True)
        self._bar = None
        if self.show and tty:
            self._bar = self._rich(done)
        elif self.show:
            announce(f"{label}: {total} calls ({done} done before)" if done else
                     f"{label}: {total} calls")

    def _rich(self, done: int):
        bar = RichProgress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TimeRemainingColumn(),
                           TextColumn("{task.fields[name]}"), transient=True)
        bar.start()
        self._task = bar.add_task(self.label, total=self.total, completed=done, name="")
        return bar

    def advance(self, name: str) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, name=name[:50])
        elif self.show and time.monotonic() - self._last >= LINE_EVERY_S:
            self._last = time.monotonic()
            announce(f"{self.label}: {self.n}/{self.total} calls, "
                     f"{self._last - self.t0:.0f} s, now {name}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextlib.contextmanager
def quiet_kineto():
    """Run the block with file descriptor 2 captured; afterwards re-emit every line but
    Kineto's own ``USDT``/``STAGE`` log lines (so warnings and errors still reach the user)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (some notebooks): nothing to do
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().splitlines(keepends=True) if not _KINETO.match(ln)]
            if kept:
                os.write(fd, b"".join(kept))
