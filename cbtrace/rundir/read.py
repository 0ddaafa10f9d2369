"""Reading a run directory: the typed manifest, the modules table, the capture trace.

A run directory is data that may come from elsewhere: every path its manifest names (``trace``,
``input_files``, the keys of ``files`` and ``files_stat``) must resolve inside it, symlinks
followed, or the manifest is refused; so no stage reads or writes outside the run on its say-so.
"""
from __future__ import annotations

from pathlib import Path

from cbtrace.errors import RunDirError, one_line
from cbtrace.rundir.layout import MANIFEST, MODULES
from cbtrace.schema import manifest as manifest_schema
from cbtrace.schema.modules import COLUMNS, ModuleRecord, frame_to_records, required_fields


def read_manifest(run) -> manifest_schema.Manifest:
    """The run's Manifest; RunDirError naming the file when it is missing or invalid."""
    path = Path(run) / MANIFEST
    if not path.is_file():
        raise RunDirError(f"{run}: not a cbtrace run directory (no {MANIFEST})")
    manifest = manifest_schema.decode(path.read_bytes(), path)
    check_paths(run, manifest, source=path)
    return manifest


def named_paths(manifest) -> list[tuple[str, str]]:
    """(field, path) of every path the manifest names, relative to the run directory."""
    out = [("trace", manifest.trace)] if manifest.trace else []
    out += [("input_files", p) for p in manifest.input_files]
    out += [("files", p) for p in manifest.files]
    out += [("files_stat", p) for p in manifest.files_stat]
    return out


def check_paths(run, manifest, *, source=None) -> None:
    """RunDirError (one line naming the field and the path) if a path the manifest names
    resolves outside the run directory."""
    for name, rel in named_paths(manifest):
        inside(run, rel, field=name, source=source)


def inside(run, rel, *, field: str, source=None) -> Path:
    """``run / rel``, if it resolves inside ``run`` (symlinks followed); else RunDirError."""
    root = Path(run).resolve()
    path = Path(run) / rel
    if not path.resolve().is_relative_to(root):
        where = source if source is not None else Path(run) / MANIFEST
        raise RunDirError(f"{where}: {field} names {str(rel)!r}, outside the run directory; "
                          "refusing to use it")
    return path


def read_modules(run):
    """modules.parquet -> pandas DataFrame with every declared column, in declaration order.

    A table without a column every capture writes is refused in one line; columns a later
    cbtrace added are filled with their defaults; undeclared columns are dropped.
    """
    import pyarrow as pa  # here: `cbtrace <cmd> --help` imports this module and must stay light
    import pyarrow.parquet as pq

    path = Path(run) / MODULES
    if not path.is_file():
        raise RunDirError(f"{run}: no {MODULES} (was the capture interrupted?)")
    try:
        df = pq.read_table(path).to_pandas()
    except (pa.ArrowInvalid, OSError) as e:
        raise RunDirError(f"{path}: corrupt Parquet file ({one_line(e, with_type=False)})") from None
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
    """The capture's Kineto trace in the run directory, if any; never a path outside it (a
    manifest naming one is refused, a link leading out is passed over)."""
    run = Path(run)
    manifest = read_manifest(run) if manifest is None else manifest
    if manifest.trace:
        named = inside(run, manifest.trace, field="trace")
        if named.is_file():
            return named
    root = run.resolve()
    found = sorted(run.glob("*.pt.trace.json*"))
    found = [p for p in found if not p.name.startswith("annotated_") and p.is_file()
             and p.resolve().is_relative_to(root)]
    return found[0] if found else None
