"""Helpers for tests that start real servers (tensorboard, vizviewer) and real Chromium."""
import os
import socket
import subprocess

CHROMIUM = os.environ.get("CBTRACE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


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
