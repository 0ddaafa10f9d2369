"""Names inside a run directory, and making a new one::

    manifest.json                 the typed record (cbtrace.schema.manifest)
    modules.parquet               one row per captured call (cbtrace.schema.modules)
    inputs/tensors-NNNNN.parquet  captured input tensors (cbtrace.store)
    <worker>.<ms>.pt.trace.json.gz  Kineto trace of the captured step
    plain_step.json.gz            Kineto trace of one more step, ranges only (capture/plain_step.py)
    replay.progress.jsonl         rows of a replay in progress (cbtrace.replay.run_io.progress)
    .cbtrace.lock                 the writer at work, or one that died (cbtrace.rundir.lock)
"""
from __future__ import annotations

from pathlib import Path

from cbtrace.errors import RunDirError

MANIFEST = "manifest.json"
MODULES = "modules.parquet"
INPUTS = "inputs"
PLAIN_TRACE = "plain_step.json.gz"


def prepare_new_run(out_dir, *, overwrite: bool = False) -> Path:
    """Create ``out_dir`` for a new run; refuse to reuse one that already holds a run."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise RunDirError(f"{out}: exists and is not a directory")
        names = {p.name for p in out.iterdir()}
        if names and not overwrite:
            # here: lock reads manifests through rundir.read, which imports this module
            from cbtrace.rundir.lock import LOCK, check_new_run

            # a run in use, or left by a command that died (a lock file alone: a capture
            # killed before its first write): say which
            check_new_run(out)
            if names - {LOCK}:
                raise RunDirError(f"{out}: already exists and is not empty; choose another run "
                                  "directory (an existing run is never overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    (out / INPUTS).mkdir(exist_ok=True)
    stale = out / PLAIN_TRACE  # an overwritten run's: this capture profiles its own, or none
    if stale.is_file() or stale.is_symlink():
        stale.unlink()
    return out
