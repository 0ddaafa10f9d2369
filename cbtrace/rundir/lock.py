"""One writer at a time: an advisory lock on a run directory (``fcntl.flock``).

Capture and replay hold ``RUN/.cbtrace.lock`` while they write; the file names its holder
(pid, host, command, start time), so a second writer is refused in one line naming it. The file
is removed when the holder ends well and kept when it fails (its ``state`` and ``error`` say
how), so a lock file whose lock is free marks a run left behind by a command that died (killed,
crashed, a full disk); ``check_new_run`` names such a run instead of calling it "not empty".
The lock is advisory and held per process: a nested hold of the same run (capture_model around
capture) only counts, and a child started by the holder (torchrun's ranks) is let through.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

from cbtrace.errors import RunDirError, one_line
from cbtrace.rundir.read import read_manifest

LOCK = ".cbtrace.lock"
ENV = "CBTRACE_RUN_LOCK"  # the run a parent process holds, for its children
_HELD: dict[str, "RunLock"] = {}  # resolved run path -> the lock this process holds


def _key(run) -> str:
    return str(Path(run).resolve())


def read_holder(run) -> dict | None:
    """What the lock file of ``run`` says (``{}`` if unreadable), or None without one."""
    try:
        text = (Path(run) / LOCK).read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        info = json.loads(text or "{}")
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def describe(info: dict) -> str:
    """'cbtrace replay (pid 123 on host, since 2026-01-01 10:00:00 UTC)'."""
    started = info.get("started")
    when = (time.strftime(", since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
            if isinstance(started, (int, float)) else "")
    return (f"{info.get('command') or 'a cbtrace command'} (pid {info.get('pid', '?')} on "
            f"{info.get('host', '?')}{when})")


class RunLock:
    """The lock on one run directory, taken by ``acquire`` and given back by ``release``.

    Use it as a context manager (``with RunLock(run, "capture"):``), or call ``acquire`` and,
    at the end, ``release(exc)`` with the exception that ends the work (None if it went well).
    ``mark=False``: a failure leaves no lock file (for writers whose outputs are atomic).
    """

    def __init__(self, run, command: str, *, mark: bool = True):
        self.run = Path(run)
        self.command = command
        self.mark = mark
        self.previous: dict | None = None  # the lock file left by a holder that died
        self._fd: int | None = None
        self._depth = 0
        self._outer: RunLock | None = None  # the lock this process already holds on the run

    def acquire(self) -> "RunLock":
        key = _key(self.run)
        held = _HELD.get(key)
        if held is not None:  # held by this process already: count, do not lock twice
            self._outer = held
            held._depth += 1
            return self
        if os.environ.get(ENV) == key or _other_rank():  # our launcher or rank 0 holds it
            self._depth = -1
            return self
        path = self.run / LOCK
        for _ in range(10):  # the holder may remove the file between our open and our flock
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:  # no such folder, or a read-only run: the caller says so, and
                self._depth = -1  # nothing can write it, so there is no writer to exclude
                return self
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirError(f"{self.run}: in use by {describe(read_holder(self.run) or {})}"
                                  "; wait for it to end, or stop it, then try again") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise RunDirError(f"{self.run}: could not take {LOCK} (it keeps being replaced)")
        self.previous = read_holder(self.run) or None
        if self.command == "replay" and self.previous and _dead_capture(self.run, self.previous):
            os.close(fd)  # the lock file stays as the dead capture left it
            raise _refused(self.run, dead_text(self.run, self.previous))
        self._fd, self._depth = fd, 1
        self._write({"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                     "argv": " ".join(sys.argv[:8])[:300], "started": time.time(),
                     "state": "running"})
        _HELD[key] = self
        os.environ[ENV] = key
        return self

    def release(self, exc: BaseException | None = None) -> None:
        """Give the lock back: the file goes when the work ended well, else it stays, saying
        how the work ended. A full disk is re-raised as one line (RunDirError)."""
        if self._outer is not None:
            self._outer._depth -= 1
            self._outer = None
        elif self._depth == 1:
            self._depth = 0
            key = _key(self.run)
            _HELD.pop(key, None)
            if os.environ.get(ENV) == key:
                del os.environ[ENV]
            try:
                if self.previous and self.command not in ("capture", "replay"):
                    self._write(self.previous)  # only a new capture or replay clears its mark
                elif exc is None or not self.mark or _nothing_written(self.run):
                    (self.run / LOCK).unlink(missing_ok=True)
                else:
                    info = read_holder(self.run) or {}
                    info.update(state="failed", error=one_line(exc), ended=time.time())
                    self._write(info)
            finally:
                os.close(self._fd)  # closing gives the flock back
                self._fd = None
        full = None if isinstance(exc, DiskFull) else disk_full(exc)
        if full is not None:
            where = f": {full.filename}" if full.filename else ""
            raise DiskFull(f"{self.run}: disk full ({full.strerror or 'ENOSPC'}{where}); what "
                           "was written is kept and the run is marked incomplete: free space, "
                           f"then {resume_hint(self.run, self.command)}",
                           retry="resume" if self.command == "replay" else None) from None

    def _write(self, info: dict) -> None:
        """Rewrite the lock file in place (it is small: a full disk rarely refuses it)."""
        data = json.dumps(info).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError:  # the file's words are a courtesy; the flock is the lock
            pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.release(exc)
        return False


def locked(command: str, *, mark: bool = True):
    """Decorator: hold the lock of the run (the function's first argument) while it runs."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(run, *args, **kwargs):
            with RunLock(run, command, mark=mark):
                return fn(run, *args, **kwargs)
        return inner
    return wrap


class DiskFull(RunDirError):
    """A write into the run found the disk full."""


def disk_full(exc) -> OSError | None:
    """The OSError ENOSPC/EDQUOT that ``exc`` is, or was raised while handling (a write's
    one-line error), else None."""
    for _ in range(5):
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc
        if exc is None:
            return None
        exc = exc.__cause__ or exc.__context__
    return None


def _other_rank() -> bool:
    """A rank other than 0 of a torchrun job (rank 0 holds the lock for the job)."""
    return (int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ
            and os.environ.get("RANK", "0") != "0")


def _nothing_written(run: Path) -> bool:
    """True when ``run`` holds no file but the lock (a failure before any write)."""
    return not any(p.is_file() and p.name != LOCK for p in run.rglob("*"))


def resume_hint(run, command: str) -> str:
    """What to do with a run ``command`` left unfinished; for a replay it names
    ``resume=True``, which the error carries as its ``retry`` for the CLI."""
    if command == "replay":
        return f"replay it again with resume=True (or remove {run})"
    return f"remove it (rm -r {run}) and capture again"


def _refused(run, text: str) -> RunDirError:
    """``run: text`` as a RunDirError; a text advising a resumed replay carries retry="resume"."""
    return RunDirError(f"{run}: {text}", retry="resume" if "resume=True" in text else None)


def check_new_run(run) -> None:
    """Before a capture into ``run``: a one-line RunDirError if a command is writing it or one
    died in it, or a capture left it unfinished (any other content is ``prepare_new_run``'s
    "not empty")."""
    run = Path(run)
    if not run.is_dir() or _key(run) in _HELD:
        return
    info = read_holder(run)
    if info is None:
        if (run / "inputs").is_dir() and not (run / "manifest.json").is_file():
            raise RunDirError(f"{run}: holds inputs/ but no manifest.json: a capture that did "
                              f"not finish; {resume_hint(run, 'capture')}, or choose another "
                              "run directory")
        _check_manifest(run)
        return
    try:
        fd = os.open(run / LOCK, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirError(f"{run}: in use by {describe(info)}; choose another run "
                          "directory") from None
    finally:
        os.close(fd)
    raise _refused(run, dead_text(run, info))


def dead_text(run, info: dict) -> str:
    """'a dead capture: capture (pid ...) gone without a word ...; remove it (...)', or 'a
    failed replay: ... stopped (error); replay it again with resume=True ...'."""
    command = info.get("command") or "cbtrace command"
    if info.get("error"):
        state, how = "failed", f"stopped ({info['error']})"
    else:
        state, how = "dead", "gone without a word (killed or crashed)"
    what = "capture" if "capture" in command or not _complete(run) else "replay"
    return f"a {state} {what}: {describe(info)} {how}; {resume_hint(run, what)}"


def _check_manifest(run: Path) -> None:
    try:
        manifest = read_manifest(run)
    except RunDirError:
        return  # prepare_new_run refuses it as not empty
    if not manifest.complete:
        why = manifest.error or "no error recorded"
        raise RunDirError(f"{run}: a capture that did not complete ({why}); "
                          f"{resume_hint(run, 'capture')}, or choose another run "
                          "directory")


def _dead_capture(run, info: dict) -> bool:
    """The lock file was left by a capture and the manifest is missing or incomplete."""
    return "capture" in (info.get("command") or "") and not _complete(run)


def _complete(run) -> bool:
    """The manifest exists and says complete (read loosely: this only picks a message)."""
    try:
        return json.loads((Path(run) / "manifest.json").read_bytes()).get("complete") is True
    except (ValueError, OSError, AttributeError):
        return False
