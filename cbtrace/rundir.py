"""Run directory I/O: manifest, modules.parquet, atomic writes, checksums.

Layout of a run directory::

    manifest.json               versions, device, model spec, options, seeds, files + sha256
    modules.parquet             one row per captured call (columns: cbtrace.schema.modules.ModuleRecord)
    inputs/tensors-NNNNN.parquet  captured input tensors (deduplicated), see cbtrace.plugins.inputs
    <worker>.pt.trace.json.gz   Kineto trace of the captured step (torch-tb-profiler naming)
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from cbtrace.errors import RunDirError

MANIFEST = "manifest.json"
REQUIRED_COLUMNS = ("fqn", "call_index", "call_id", "parent_call_id", "depth", "module_type",
                    "inputs_ref")
MODULES = "modules.parquet"
INPUTS = "inputs"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_path(path: Path):
    """Context manager yielding a temp path that is renamed to ``path`` on success."""
    import contextlib

    @contextlib.contextmanager
    def _cm():
        p = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        os.close(fd)
        try:
            yield Path(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    return _cm()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare_new_run(out_dir, *, overwrite: bool = False) -> Path:
    """Create ``out_dir`` for a new run; refuse to reuse one that already holds a run."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise RunDirError(f"{out}: exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise RunDirError(f"{out}: already exists and is not empty; choose a new --out "
                              "(an existing run is never overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    (out / INPUTS).mkdir(exist_ok=True)
    return out


def write_manifest(run: Path, manifest: dict) -> None:
    atomic_write_bytes(Path(run) / MANIFEST,
                       json.dumps(manifest, indent=2, sort_keys=True).encode())


def read_manifest(run) -> dict:
    path = Path(run) / MANIFEST
    if not path.is_file():
        raise RunDirError(f"{run}: not a cbtrace run directory (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunDirError(f"{path}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise RunDirError(f"{path}: corrupt manifest (not a JSON object)")
    return manifest


def refresh_checksums(run, known: dict | None = None, rewritten=(), manifest=None) -> dict:
    """Store the sha256 of every file of the run in the manifest.

    New files are hashed (or take the digest their writer computed: ``known``, path -> sha256).
    A file already recorded keeps its recorded digest unless cbtrace says it rewrote it
    (``rewritten``: paths relative to the run), so a corrupted capture file is never blessed
    with a new digest; replay verifies the captured inputs against them. A ``manifest`` given
    in memory (not yet written) is completed and written once.
    """
    run = Path(run)
    manifest = read_manifest(run) if manifest is None else manifest
    old, old_stat = manifest.get("files", {}), manifest.get("files_stat", {})
    known = {str(Path(p).resolve().relative_to(run.resolve())): d for p, d in (known or {}).items()}
    rewritten = {str(r) for r in rewritten}
    files, stats = dict(old), dict(old_stat)
    for p in sorted(run.rglob("*")):
        if not p.is_file() or p.name == MANIFEST or p.name.startswith("."):
            continue
        rel, st = str(p.relative_to(run)), p.stat()
        if rel in known:
            files[rel] = known[rel]
        elif rel not in old or rel in rewritten:
            files[rel] = sha256_file(p)
        else:
            continue  # recorded before and not rewritten by cbtrace: keep what was recorded
        stats[rel] = [st.st_size, st.st_mtime_ns]
    manifest["files"], manifest["files_stat"] = files, stats
    write_manifest(run, manifest)
    return manifest


def read_modules(run):
    """modules.parquet -> pandas DataFrame; a clear error for a missing or corrupt file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(run) / MODULES
    if not path.is_file():
        raise RunDirError(f"{run}: no {MODULES} (was the capture interrupted?)")
    try:
        df = pq.read_table(path).to_pandas()
    except (pa.ArrowInvalid, OSError) as e:
        raise RunDirError(f"{path}: corrupt Parquet file ({e})") from None
    return df


def require_columns(run, df, columns=REQUIRED_COLUMNS) -> None:
    """A clear error when modules.parquet lacks what a command needs."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise RunDirError(f"{Path(run) / MODULES}: not a complete cbtrace modules table "
                          f"(missing {', '.join(missing)})")


def write_modules(run, df) -> None:
    """Write the modules table (a DataFrame or a pyarrow Table) atomically (never leaves a
    half-written file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = df if isinstance(df, pa.Table) else pa.Table.from_pandas(df, preserve_index=False)
    with atomic_path(Path(run) / MODULES) as tmp:
        pq.write_table(table, tmp)


def load_run(run):
    """(manifest, modules DataFrame) of a run directory."""
    return read_manifest(run), read_modules(run)


def find_trace(run) -> Path | None:
    """The capture's Kineto trace in the run directory, if any."""
    run = Path(run)
    name = read_manifest(run).get("trace")
    if name and (run / name).is_file():
        return run / name
    found = sorted(run.glob("*.pt.trace.json*"))
    found = [p for p in found if not p.name.startswith("annotated_")]
    return found[0] if found else None


def load_inputs(run, fqn: str, call_index: int = 0, device=None):
    """``(args, kwargs)`` of one captured call, bit-identical to what the module received.

    Args:
        run: run directory.
        fqn: module path as in ``named_modules()`` ("" for the root).
        call_index: which call of that module (0 = first).
        device: move tensors there (default: the device they were captured on, if present).
    """
    from cbtrace.store.load import load_call_inputs

    df = read_modules(run)
    rows = df[(df["fqn"] == fqn) & (df["call_index"] == call_index)]
    if rows.empty:
        known = ", ".join(sorted(set(df["fqn"]))[:8])
        raise RunDirError(f"{run}: no captured call '{fqn}' #{call_index} (known: {known} ...)")
    return load_call_inputs(Path(run), rows.iloc[0]["inputs_ref"], device=device)
