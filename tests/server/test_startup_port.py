"""`devharness serve` holds its port from before its workers start (server/app.py, server/starting.py): a port a
script picked free (the ephemeral range, as test fixtures pick them) cannot be taken by the run's own connections
while the model loads; meanwhile every request gets a 503 `starting` with Retry-After; the listener is never
inherited by a worker process."""
import errno
import signal
import socket

import httpx
import psutil
import pytest

from devharness.server.starting import RETRY_AFTER_S, StartupResponder
from tests.helpers import served_url, start_serve, wait_until


def ephemeral_port() -> int:
    """A port the kernel says is free now, closed again: what a script that picks a port does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_on(proc: psutil.Process, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp"))
    except psutil.NoSuchProcess:
        return False


def workers(server: psutil.Process) -> list[psutil.Process]:
    """The mp workers: the children of the forkserver the server started (they carry its command line)."""
    try:
        return [w for c in server.children() if "forkserver" in " ".join(c.cmdline()) for w in c.children()]
    except psutil.NoSuchProcess:
        return []


def stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def assert_starting(resp: httpx.Response):
    assert resp.status_code == 503 and resp.headers["Retry-After"] == str(RETRY_AFTER_S), resp.text
    body = resp.json()
    assert body["reason"] == body["error"]["code"] == "starting" and body["error"]["type"] == "server_error"


def test_the_startup_responder_answers_503_and_leaves_the_socket_to_the_server():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        responder = StartupResponder(sock)
        try:
            with httpx.Client(base_url=url, timeout=10) as http:
                assert_starting(http.get("/health"))
                assert_starting(http.post("/v1/completions", json={"prompt": "x" * 100_000, "max_tokens": 1}))
                head = http.head("/health")
                assert head.status_code == 503 and head.content == b""
        finally:
            responder.close()
        responder.close()   # a second close (serve's finally after the server took over) changes nothing
        # The listener is still open: a connection made now waits in its backlog for whoever accepts next.
        with socket.create_connection(sock.getsockname()[:2], timeout=10) as client:
            sock.settimeout(10)
            conn, _ = sock.accept()
            conn.close()
            assert client.recv(1) == b""


def test_serve_listens_before_its_workers_start_and_they_never_hold_the_listener():
    port = ephemeral_port()
    proc, lines = start_serve("--executor", "mp", "--tp", "2", port=port)
    try:
        server = psutil.Process(proc.pid)
        wait_until(lambda: workers(server) or proc.poll() is not None, 120, "a worker process")
        assert proc.poll() is None, "".join(lines)
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        url = f"http://127.0.0.1:{port}"
        # Still loading (the workers were only just forked): every request is answered at once, not held.
        assert_starting(httpx.get(f"{url}/health", timeout=10))
        assert_starting(httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=10))
        assert served_url(proc, lines) == url
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        # The server itself listens on the port (so the look below can see a listener); none of its children does.
        assert listening_on(server, port)
        family = server.children(recursive=True)
        assert len(workers(server)) == 2 and not [p.pid for p in family if listening_on(p, port)]
    finally:
        assert stop(proc) == 0, "".join(lines)


def test_serve_comes_up_on_freshly_picked_free_ports():
    for _ in range(5):
        port = ephemeral_port()
        proc, lines = start_serve("--executor", "uni", port=port)
        try:
            url = served_url(proc, lines)
            assert url == f"http://127.0.0.1:{port}"
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        finally:
            assert stop(proc) == 0, "".join(lines)
