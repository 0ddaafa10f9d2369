"""Reading a run directory: the typed manifest, the modules table, the capture trace."""
from __future__ import annotations

from pathlib import Path

from cbtrace.errors import RunDirError
from cbtrace.rundir.layout import MANIFEST, MODULES
from cbtrace.schema import manifest as manifest_schema
from cbtrace.schema.modules import COLUMNS, ModuleRecord, frame_to_records, required_fields


def read_manifest(run) -> manifest_schema.Manifest:
    """The run's Manifest; RunDirError naming the file when it is missing or invalid."""
    path = Path(run) / MANIFEST
    if not path.is_file():
        raise RunDirError(f"{run}: not a cbtrace run directory (no {MANIFEST})")
    return manifest_schema.decode(path.read_bytes(), path)


def read_modules(run):
    """modules.parquet -> pandas DataFrame with every declared column, in declaration order.

    A table without a column every capture writes is refused in one line; columns a later
    cbtrace added are filled with their defaults; undeclared columns are dropped.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(run) / MODULES
    if not path.is_file():
        raise RunDirError(f"{run}: no {MODULES} (was the capture interrupted?)")
    try:
        df = pq.read_table(path).to_pandas()
    except (pa.ArrowInvalid, OSError) as e:
        raise RunDirError(f"{path}: corrupt Parquet file ({e})") from None
    missing = [c for c in required_fields() if c not in df.columns]
    if missing:
        raise RunDirError(f"{path}: not a cbtrace modules table (missing {', '.join(missing)})")
    defaults = ModuleRecord.__dataclass_fields__
    for name in COLUMNS:
        if name not in df.columns:
            df[name] = defaults[name].default
    return df[list(COLUMNS)]


def read_records(run) -> list[ModuleRecord]:
    return frame_to_records(read_modules(run))


def load_run(run):
    """(Manifest, modules DataFrame) of a run directory."""
    return read_manifest(run), read_modules(run)


def find_trace(run, manifest=None) -> Path | None:
    """The capture's Kineto trace in the run directory, if any."""
    run = Path(run)
    manifest = read_manifest(run) if manifest is None else manifest
    if manifest.trace and (run / manifest.trace).is_file():
        return run / manifest.trace
    found = sorted(run.glob("*.pt.trace.json*"))
    found = [p for p in found if not p.name.startswith("annotated_")]
    return found[0] if found else None
