"""The server helper starts a server again on another port when its first port was taken."""
import socket
import sys
import urllib.request

from helpers import servers


def test_a_server_whose_port_was_taken_is_started_on_another(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = taken.getsockname()[1]
        ports = iter([first])
        real = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real())

        def argv(port):
            return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]

        def ready(port):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
            return True

        proc, port = servers.serve(argv, ready, timeout=30)
        try:
            assert port != first and proc.poll() is None
        finally:
            servers.stop(proc)
