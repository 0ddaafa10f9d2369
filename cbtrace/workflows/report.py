"""``cbtrace report``: run the chosen reporters over one run directory."""
from __future__ import annotations

from pathlib import Path

from cbtrace.errors import CbtraceError, RunDirError

DEFAULT_REPORTERS = ("icicle", "summary")


class ReportError(CbtraceError):
    """A reporter is unknown or failed on a run."""


def report_run(run, *, out_dir=None, names=DEFAULT_REPORTERS) -> list[Path]:
    """Write the reports ``names`` of RUN into ``out_dir`` (default: RUN); the paths written.

    Args:
        run: run directory (manifest.json + modules.parquet).
        out_dir: where the files go (created if missing).
        names: registered reporter names, e.g. ("icicle", "svg", "summary").
    """
    from cbtrace import registry
    from cbtrace.rundir import load_run

    manifest, df = load_run(run)
    df.attrs["manifest"] = manifest
    if df.empty:
        raise RunDirError(f"{run}: modules.parquet holds no module calls")
    table = registry.reporters()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ReportError(f"unknown reporter(s) {', '.join(unknown)}; "
                          f"registered: {', '.join(sorted(table))}")
    out = Path(out_dir) if out_dir is not None else Path(run)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name in names:
        reporter = table[name]
        try:
            written += list(reporter.report(df, out) or [])
        except (ValueError, KeyError, OSError) as e:
            raise ReportError(f"{run}: reporter '{name}' failed: {e}") from e
        finally:
            reporter.close()
    return written
