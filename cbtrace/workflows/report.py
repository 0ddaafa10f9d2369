"""``cbtrace report``: run the chosen reporters over one run directory."""
from __future__ import annotations

from pathlib import Path

from cbtrace import registry
from cbtrace.errors import CbtraceError, RunDirError, one_line
from cbtrace.rundir.read import load_run
from cbtrace.schema.modules import frame_to_records

DEFAULT_REPORTERS = ("icicle", "summary")


class ReportError(CbtraceError):
    """A reporter is unknown or failed on a run."""


def report_run(run, *, out_dir=None, names=DEFAULT_REPORTERS) -> list[Path]:
    """Write the reports ``names`` of RUN into ``out_dir`` (default: RUN); the paths written.

    Each reporter gets the run's ModuleRecords and its Manifest.

    Args:
        run: run directory (manifest.json + modules.parquet).
        out_dir: where the files go (created if missing).
        names: registered reporter names, e.g. ("icicle", "svg", "summary").
    """
    manifest, df = load_run(run)
    if df.empty:
        raise RunDirError(f"{run}: modules.parquet holds no module calls")
    records = frame_to_records(df)
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
            written += list(reporter.report(records, manifest, out) or [])
        except (ValueError, KeyError, OSError) as e:
            raise ReportError(f"{run}: reporter '{name}' failed: {one_line(e)}") from e
        finally:
            reporter.close()
    return written


def write_report(run, out_dir=None, *, svg: bool = True) -> Path:
    """icicle.html (+ icicle.svg, summary.txt) of a run directory; returns the icicle.html path
    (the demo's report step)."""
    names = ("icicle", "summary") + (("svg",) if svg else ())
    return report_run(run, out_dir=out_dir, names=names)[0]
