"""The one writer of a run directory: stages return columns, this merges them.

Capture writes the whole table once (``write_records``); every later stage hands over the
columns it produced per call (``write_stage``, or ``write_columns`` then ``write_manifest``
when the manifest is to say how long the table took), which must be declared for that stage in
``cbtrace.schema.modules``; the table is rewritten atomically and the manifest, with fresh
checksums, is written once at the end (``write_manifest``).
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cbtrace.console import announce
from cbtrace.errors import RunDirError, SchemaError
from cbtrace.rundir.files import atomic_path, atomic_write_bytes, sha256_file
from cbtrace.rundir import signature
from cbtrace.rundir.signature import SIGNATURE
from cbtrace.rundir.layout import MANIFEST, MODULES
from cbtrace.rundir.read import read_manifest, read_modules
from cbtrace.schema import manifest as manifest_schema
from cbtrace.schema.modules import (COLUMNS, DERIVED, ModuleRecord, arrow_schema,
                                    records_to_table, stage_columns)


def write_records(run, records) -> None:
    """The capture stage: every row, capture columns filled, the rest at their defaults."""
    _write_table(run, records_to_table(records))


def write_stage(run, stage: str, by_call: dict[int, dict], manifest=None):
    """Set ``stage``'s columns from ``by_call`` (``write_columns``), then write the manifest
    (``manifest`` if given, else the one on disk) with fresh checksums.
    Returns the new modules DataFrame."""
    df = write_columns(run, stage, by_call)
    write_manifest(run, manifest if manifest is not None else read_manifest(run),
                   rewritten=[MODULES])
    return df


def write_columns(run, stage: str, by_call: dict[int, dict], table=None):
    """Set ``stage``'s columns from ``by_call`` (call_id -> {column: value}; a call or a column
    left out gets the column's default), clear the stages derived from it and rewrite the
    table; the caller writes the manifest next (``write_manifest``, ``rewritten=[MODULES]``).
    ``table``: the modules DataFrame as read (``read_modules``), else it is read again; it is
    changed in place and returned."""
    allowed = stage_columns(stage)
    extra = sorted({k for row in by_call.values() for k in row} - set(allowed))
    if extra:
        raise SchemaError(f"stage '{stage}' wrote undeclared column(s) {', '.join(extra)} "
                          "(declare them in cbtrace/schema/modules.py)")
    df = read_modules(run) if table is None else table
    defaults = ModuleRecord.__dataclass_fields__
    cleared = [c for s in DERIVED.get(stage, ()) for c in stage_columns(s)]
    for name in allowed:
        default = defaults[name].default
        df[name] = [by_call.get(cid, {}).get(name, default) for cid in df["call_id"]]
    for name in cleared:
        df[name] = defaults[name].default
    _write_table(run, pa.Table.from_pandas(df, schema=arrow_schema(), preserve_index=False))
    return df


def write_manifest(run, manifest, *, known: dict | None = None, rewritten=(),
                   sign: bool | None = None) -> None:
    """Store the sha256 of every file of the run in ``manifest`` and write it.

    New files are hashed (or take the digest their writer computed: ``known``, path -> sha256).
    A file already recorded keeps its recorded digest unless cbtrace says it rewrote it
    (``rewritten``: paths relative to the run), so a corrupted capture file is never blessed
    with a new digest; replay verifies the captured inputs against them.

    ``sign``: sign the manifest with this user's key (``cbtrace.rundir.signature``); None
    signs a new run (no manifest yet) and one whose signature held before this write for the
    same model source, and drops the signature of any other.
    """
    run = Path(run)
    if sign is None:
        sign = _keeps_signature(run, manifest)
    known = {str(Path(p).resolve().relative_to(run.resolve())): d for p, d in (known or {}).items()}
    rewritten = {str(r) for r in rewritten}
    files, stats = dict(manifest.files), dict(manifest.files_stat)
    for p in sorted(run.rglob("*")):
        if not p.is_file() or p.name in (MANIFEST, SIGNATURE) or p.name.startswith("."):
            continue
        rel, st = str(p.relative_to(run)), p.stat()
        if rel in known:
            files[rel] = known[rel]
        elif rel not in files or rel in rewritten:
            files[rel] = sha256_file(p)
        else:
            continue  # recorded before and not rewritten by cbtrace: keep what was recorded
        stats[rel] = (st.st_size, st.st_mtime_ns)
    manifest.files, manifest.files_stat = files, stats
    data = manifest_schema.encode(manifest)
    atomic_write_bytes(run / MANIFEST, data)
    if not sign:
        signature.unsign(run)
        return
    try:
        signature.sign(run, data)
    except RunDirError as e:  # no key could be made or read: the run stays usable, unsigned
        signature.unsign(run)
        announce(f"{run} is not signed ({e}): replay rebuilds its model from its spec only "
                 "once it is trusted (cbtrace trust)")


def _keeps_signature(run: Path, manifest) -> bool:
    """A new run, or one signed by this user whose model source this write keeps."""
    if not (run / MANIFEST).exists():
        return True
    signed = signature.signed_manifest(run)
    return signed is not None and signed.model == manifest.model


def _write_table(run, table) -> None:
    assert table.column_names == list(COLUMNS), "modules.parquet keeps the declared columns"
    with atomic_path(Path(run) / MODULES) as tmp:
        pq.write_table(table, tmp)
