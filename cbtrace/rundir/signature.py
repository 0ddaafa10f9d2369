"""Runs this user made are trusted: the manifest is signed with a per-user secret key.

As Jupyter signs notebooks: at capture, ``manifest.sig`` beside ``manifest.json`` holds an
HMAC-SHA256 of the manifest's bytes (which hold every file's sha256) under a random key kept
0600 in the user's config directory (``$CBTRACE_CONFIG_DIR``, else
``$XDG_CONFIG_HOME/cbtrace``, else ``~/.config/cbtrace``). A run whose signature checks may
rebuild its model from the code its spec names; any edit of the manifest breaks the signature,
and a run from elsewhere is signed only by ``cbtrace trust RUN``. A later write by cbtrace
itself (replay's table and checksums) signs again only a run whose signature held before.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cbtrace.errors import RunDirError
from cbtrace.rundir.files import atomic_write_bytes, sha256_file
from cbtrace.rundir.layout import MANIFEST
from cbtrace.rundir.read import read_manifest
from cbtrace.schema import manifest as manifest_schema

SIGNATURE = "manifest.sig"
PREFIX = "hmac-sha256:"
KEY_ENV = "CBTRACE_CONFIG_DIR"


class TrustError(RunDirError):
    """The signing key cannot be made or read safely."""


def config_dir() -> Path:
    """Where the user's key lives."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "cbtrace"


def key_path() -> Path:
    return config_dir() / "key"


def load_key(*, create: bool) -> bytes | None:
    """The user's key; made (0600) when missing and ``create``, else None when missing.
    TrustError when it is readable by others (anyone who reads it can forge a signature)."""
    path = key_path()
    if not path.exists():
        if not create:
            return None
        _create_key(path)
    st = path.stat()
    if st.st_mode & 0o077:
        raise TrustError(f"{path}: the signing key is readable by other users "
                         f"(chmod 600 {path}); runs are not signed or trusted with it")
    data = path.read_bytes().strip()
    if len(data) < 32:
        raise TrustError(f"{path}: not a cbtrace signing key (remove it to make a new one)")
    return data


def _create_key(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # O_EXCL: two captures at once keep the first key; the loser reads it
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as e:
        raise TrustError(f"{path}: cannot create the signing key ({e.strerror or e})") from None
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode() + b"\n")


def digest(key: bytes, manifest_bytes: bytes) -> str:
    """The signature of a manifest's bytes (its files' sha256 are inside them)."""
    return PREFIX + hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()


def signed_bytes(run) -> bytes | None:
    """The manifest's bytes if ``run`` carries a valid signature of them by this user, else
    None (no signature, another user's, an edited manifest, or no key here)."""
    run = Path(run)
    try:
        data = (run / MANIFEST).read_bytes()
        sig = (run / SIGNATURE).read_text().strip()
        key = load_key(create=False)
    except (OSError, UnicodeDecodeError, TrustError):
        return None
    if key is None or not hmac.compare_digest(sig.encode(), digest(key, data).encode()):
        return None
    return data


def signed_manifest(run):
    """The run's Manifest as signed (decoded from the very bytes checked), or None."""
    data = signed_bytes(run)
    if data is None:
        return None
    try:
        return manifest_schema.decode(data, Path(run) / MANIFEST)
    except RunDirError:
        return None


def sign(run, manifest_bytes: bytes | None = None) -> Path:
    """Write ``manifest.sig`` for the manifest as it is on disk (or ``manifest_bytes``, what
    was just written there); the key is made on first use."""
    run = Path(run)
    data = manifest_bytes if manifest_bytes is not None else (run / MANIFEST).read_bytes()
    path = run / SIGNATURE
    atomic_write_bytes(path, (digest(load_key(create=True), data) + "\n").encode())
    return path


def unsign(run) -> None:
    """Remove a signature that no longer holds (a stale one is never left beside the data)."""
    (Path(run) / SIGNATURE).unlink(missing_ok=True)


def trust(run, shown: bytes | None = None) -> Path:
    """Sign ``run`` with this user's key after the user has read what it runs (``cbtrace
    trust``): RunDirError, signing nothing, if the manifest is invalid or a file it lists is
    missing or differs from its recorded sha256 (every byte is read: the run is from
    elsewhere, so its recorded sizes and times prove nothing). ``shown``: the manifest's bytes
    the user read; a manifest changed since is refused."""
    run = Path(run)
    data = (run / MANIFEST).read_bytes() if (run / MANIFEST).is_file() else None
    if shown is not None and data != shown:
        raise RunDirError(f"{run / MANIFEST}: changed since it was shown; not signed")
    manifest = read_manifest(run)  # one line naming the file if it is missing or invalid
    for rel, want in sorted(manifest.files.items()):
        path = run / rel
        if not path.is_file():
            raise RunDirError(f"{path}: listed in the manifest but missing; not signed")
        if sha256_file(path) != want:
            raise RunDirError(f"{path}: sha256 differs from the manifest; not signed")
    return sign(run, data)
