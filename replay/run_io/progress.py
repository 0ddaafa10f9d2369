"""Rows are appended as they finish (JSON lines), so --resume completes a killed replay.

Each row is flushed to the OS at once (a killed process loses nothing); fsync, which only a
machine crash needs, runs at most once per ``SYNC_EVERY_S`` and at close. A resumed log whose
last line was torn (the process died mid-write) is continued on a new line, so the torn row is
the only one lost.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from cbtrace.errors import ReplayError

PROGRESS = "replay.progress.jsonl"
SYNC_EVERY_S = 1.0


def progress_name(rank: int | None = None) -> str:
    """The progress file of a replay, or of one rank of a sharded replay."""
    return PROGRESS if rank is None else f"replay.progress.rank-{rank}.jsonl"


def read_done(run: Path) -> dict[int, dict]:
    """call_id -> result row of every call already finished, by any rank (a torn last line is
    ignored; a call timed again later keeps its last row)."""
    done = {}
    for path in sorted(Path(run).glob("replay.progress*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                done[int(row["call_id"])] = row
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a torn last line (the process died mid-write), or not ours: redo it
    return done


def clear_progress(run: Path) -> None:
    """A new (not resumed) replay: the rows of earlier ones go, every rank's."""
    for old in Path(run).glob("replay.progress*.jsonl"):
        old.unlink(missing_ok=True)


class ProgressLog:
    def __init__(self, run: Path, *, resume: bool, rank: int | None = None):
        self.path = Path(run) / progress_name(rank)
        try:
            torn = resume and not _ends_a_line(self.path)
            self.f = open(self.path, "a")
        except OSError as e:
            raise ReplayError(f"{self.path}: cannot write ({e.strerror or e}): replay writes its "
                              "results into the run directory; replay a writable copy") from None
        if torn:
            self.f.write("\n")
        self._synced = time.monotonic()

    def append(self, row: dict) -> None:
        self.f.write(json.dumps(row, default=_plain) + "\n")
        self.f.flush()
        if time.monotonic() - self._synced >= SYNC_EVERY_S:
            os.fsync(self.f.fileno())
            self._synced = time.monotonic()

    def close(self) -> None:
        if self.f.closed:
            return
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
        finally:
            self.f.close()


def _ends_a_line(path: Path) -> bool:
    """True if ``path`` is missing, empty or ends with a newline."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return True
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except FileNotFoundError:
        return True


def _plain(x):
    try:
        return x.item()
    except AttributeError:
        return str(x)
