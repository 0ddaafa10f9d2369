"""Rows are appended as they finish (JSON lines, fsynced), so --resume completes a killed replay."""
from __future__ import annotations

import json
import os
from pathlib import Path

PROGRESS = "replay.progress.jsonl"


def read_done(run: Path) -> dict[int, dict]:
    """call_id -> result row of every call already finished (a torn last line is ignored)."""
    path = Path(run) / PROGRESS
    done = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            done[int(row["call_id"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn last line (the process died mid-write), or not ours: redo it
    return done


class ProgressLog:
    def __init__(self, run: Path, *, resume: bool):
        self.path = Path(run) / PROGRESS
        if not resume and self.path.exists():
            self.path.unlink()
        self.f = open(self.path, "a")

    def append(self, row: dict) -> None:
        self.f.write(json.dumps(row, default=_plain) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def _plain(x):
    try:
        return x.item()
    except AttributeError:
        return str(x)
