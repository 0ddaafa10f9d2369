"""Atomic writes and checksums: a reader never sees a half-written file."""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from cbtrace.errors import RunDirError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over ``path``."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: Path):
    """A temp path beside ``path``, renamed over it on success and removed on failure.

    The temp file is created on entry, so a folder that is missing or not writable is a
    one-line RunDirError before the caller does any work.
    """
    p = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise RunDirError(f"{p}: cannot write ({_why(p, e)})") from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        try:
            os.replace(tmp, p)
        except OSError as e:
            raise RunDirError(f"{p}: cannot write ({_why(p, e)})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_paths(*paths: Path):
    """Temp paths beside each of ``paths``, all created on entry; on success renamed over them,
    the last first (so the first, the main output, appears only once the others are in place);
    on failure all removed, leaving every one of ``paths`` as it was."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(atomic_path(p)) for p in paths]


def check_writable(folder: Path) -> None:
    """A one-line RunDirError now if no file can be created in ``folder`` (a read-only run),
    rather than after minutes of work."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".cbtrace-write-check.", dir=folder)
    except OSError as e:
        raise RunDirError(f"{folder}: cannot create files here ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)


def _why(path: Path, e: OSError) -> str:
    if isinstance(e, FileNotFoundError) and not path.parent.is_dir():
        return f"no folder {path.parent}"
    if isinstance(e, PermissionError):
        return f"{path.parent} is not writable"
    return e.strerror or str(e)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
