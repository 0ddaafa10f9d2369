"""A run's view under a TensorBoard logdir: ``LOGDIR/<run name>/`` with what the tabs read.

The run stays where it was written; the view holds its manifest, modules table and Kineto
traces (hard links where the filesystem allows, else copies), not its captured inputs, so the
cbtrace tab and torch-tb-profiler find it while replay keeps using the run itself.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from cbtrace.errors import RunDirError
from cbtrace.rundir.layout import MANIFEST, MODULES


def logdir_target(run, logdir) -> Path:
    """``logdir/<run name>``, or the run itself where it lies under ``logdir`` already;
    RunDirError now if another file is there (checked before any work)."""
    if already_there(run, logdir):
        return Path(run)
    target = Path(logdir) / Path(run).name
    if target.exists() or target.is_symlink():
        raise RunDirError(f"{target}: already exists; choose another logdir or run name")
    return target


def place_in_logdir(run, logdir) -> Path:
    """Put the run's view at ``logdir/<run name>`` (all files or none); its path."""
    run = Path(run)
    target = logdir_target(run, logdir)
    if target == run:
        return run
    names = [MANIFEST, MODULES] + sorted(
        p.name for p in run.glob("*.pt.trace.json*") if p.is_file() and not p.is_symlink())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
        for name in names:
            _link_or_copy(run / name, tmp / name)
        os.rename(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunDirError(f"{target}: cannot place the run there ({e.strerror or e})") from None
    return target


def already_there(run, logdir) -> bool:
    """The run lies under the logdir, where TensorBoard finds it (at any depth)."""
    return Path(run).resolve().is_relative_to(Path(logdir).resolve())


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)
