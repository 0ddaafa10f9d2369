"""Helpers for tests that start real servers (tensorboard, vizviewer) and real Chromium."""
import socket
import subprocess

from screenshot import CHROMIUM_ARGS  # noqa: F401 (re-exported)

CHROMIUM = "/usr/bin/chromium"


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """Terminate a server process, killing it if it does not exit within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
