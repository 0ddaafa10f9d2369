"""Helpers for tests that start real servers (tensorboard, vizviewer) and real Chromium."""
import os
import socket
import subprocess
import tempfile
import time
from typing import Callable

CHROMIUM = os.environ.get("CBTRACE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What tensorboard, werkzeug and http.server print when the port was taken before they bound it.
BIND_FAILED = ("could not bind", "already in use", "EADDRINUSE")


def serve(argv: Callable[[int], list[str]], ready: Callable[[int], bool], timeout: float,
          tries: int = 3) -> tuple[subprocess.Popen, int]:
    """Start ``argv(port)`` on a free port; return (process, port) once ``ready(port)`` holds.

    A port found free can be handed to another socket before the server binds it (the kernel
    gives the same range to outgoing connections), so a server that exits saying its port was
    taken is started again on another. Its stderr goes to a file: a pipe nobody reads while
    it runs fills up and stalls a chatty server.
    """
    for attempt in range(tries):
        port = free_port()
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen(argv(port), stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            try:
                if ready(port):
                    return proc, port
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                stop(proc)
                raise AssertionError(f"{argv(port)[0]} not ready after {timeout} s")
            time.sleep(0.3)
        err.seek(0)
        text = err.read().decode(errors="replace")
        if attempt == tries - 1 or not any(s in text for s in BIND_FAILED):
            raise AssertionError(f"{argv(port)[0]} exited {proc.returncode}: {text[-2000:]}")
    raise AssertionError("unreachable")


def stop(proc: subprocess.Popen) -> None:
    """Terminate a server process, killing it if it does not exit within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def launch(playwright):
    """Headless Chromium (Playwright) with the flags above."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def block_network(page) -> list[str]:
    """Abort every request that is not file:// or data:; returns the list of attempted URLs."""
    attempted: list[str] = []

    def handle(route):
        url = route.request.url
        if url.startswith(("file://", "data:")):
            route.continue_()
        else:
            attempted.append(url)
            route.abort()

    page.route("**/*", handle)
    return attempted
