"""Runs under a TensorBoard logdir, and safe resolution of run / trace names from requests.

A run is any directory (at any depth, symlinked directories not followed) that holds both
``manifest.json`` and ``modules.parquet``. Names from the browser are checked twice: their
shape (relative, no "..", no NUL) and membership (a run we found; a trace file listed in it),
so nothing outside the logdir can be read.
"""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

MANIFEST, MODULES = "manifest.json", "modules.parquet"
ANNOTATED = re.compile(r"^annotated_[\w.+-]+\.pt\.trace\.json(\.gz)?$")
SKIP_DIRS = {"inputs", "__pycache__", "plugins"}


class BadName(ValueError):
    """A malformed name (absolute, "..", NUL, ...): HTTP 400."""


class NotFound(LookupError):
    """A well-formed name that is not a run or trace under the logdir: HTTP 404."""


def find_runs(logdir, *, limit: int | None = None) -> list[str]:
    """Run directories under ``logdir`` as POSIX paths relative to it ("." for logdir itself)."""
    if not logdir or not os.path.isdir(logdir):
        return []
    found = []
    for root, dirs, files in os.walk(logdir, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        if MANIFEST in files and MODULES in files:
            found.append(Path(root).relative_to(logdir).as_posix())
            if limit is not None and len(found) >= limit:
                break
    return sorted(found)


def _check_shape(name) -> PurePosixPath:
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise BadName(f"bad name {name!r}")
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or re.match(r"^[A-Za-z]:", name):
        raise BadName(f"bad name {name!r}")
    return p


def resolve_run(logdir, run: str, runs: list[str] | None = None) -> Path:
    """The directory of ``run`` (a name from ``find_runs``); BadName or NotFound otherwise."""
    _check_shape(run)
    known = runs if runs is not None else find_runs(logdir)
    if run not in known:
        raise NotFound(f"no run {run!r} under the logdir")
    base = Path(logdir).resolve()
    path = (base / run).resolve()
    if path != base and base not in path.parents:
        raise NotFound(f"run {run!r} resolves outside the logdir")
    return path


def annotated_traces(run_dir) -> list[str]:
    """File names of annotated Kineto traces (``annotated_*.pt.trace.json[.gz]``) in a run."""
    run_dir = Path(run_dir)
    return sorted(p.name for p in run_dir.iterdir()
                  if ANNOTATED.match(p.name) and p.is_file() and not p.is_symlink())


def resolve_trace(logdir, run: str, name: str, runs: list[str] | None = None) -> Path:
    """Path of the annotated trace ``name`` of ``run``; BadName or NotFound otherwise."""
    run_dir = resolve_run(logdir, run, runs)
    if not isinstance(name, str) or not ANNOTATED.match(name):
        raise BadName(f"bad trace name {name!r}")
    if name not in annotated_traces(run_dir):
        raise NotFound(f"no trace {name!r} in run {run!r}")
    return run_dir / name
