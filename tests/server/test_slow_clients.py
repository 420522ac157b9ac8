"""Clients that stall or leave never hold the server: a body that stops coming is answered 408 and its
connection closed, headers that stop coming are cut off, and a non-streaming request whose client disconnects
is aborted in the engine with one quiet log line (no ERROR, no traceback), while the server serves the others.
The engine is held paused where a request must stay unfinished."""
import asyncio
import gc
import json
import logging
import socket
import time

import httpx
import pytest

from devharness.engine.args import EngineArgs
from devharness.server.app import build_app
from tests.helpers import wait_until
from tests.server import serve_app

COMPLETION = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return tiny_engine


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (the socket's timeout bounds the wait)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _serves(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_a_disconnected_non_stream_request_is_aborted_quietly(llm, caplog):
    with serve_app(build_app(llm)) as url, caplog.at_level(logging.DEBUG):
        asyncio.run(llm.pause())   # the request stays unfinished until its client leaves
        try:
            for n in (1, 3):   # one choice, and several gathered
                body = json.dumps({**COMPLETION, "n": n}).encode()
                sock = _connect(url)
                sock.sendall(_post_head("/v1/completions", len(body)) + body)
                wait_until(lambda: llm.num_requests == n, 30, f"the request's {n} choices in the engine")
                sock.close()
                wait_until(lambda: llm.num_requests == 0, 30, "the engine to abort the disconnected request")
        finally:
            asyncio.run(llm.resume())
        _serves(url)
        gc.collect()   # an unretrieved future's error is logged when it is collected
        time.sleep(0.2)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("devharness.server")]
    assert sum("closed the connection" in m for m in said) == 2, said


IDLE_S, TOTAL_S, HEADERS_S = 1.0, 3.0, 2.0
# Generous: what each wait may take past its timeout on a loaded machine.
MARGIN_S = 20.0
STALLED = 30   # clients


@pytest.fixture(scope="module")
def strict_url(llm):
    """A server that cuts off stalled bodies and headers after IDLE_S / TOTAL_S / HEADERS_S."""
    with serve_app(build_app(llm, body_idle_s=IDLE_S, body_total_s=TOTAL_S), header_timeout_s=HEADERS_S) as url:
        yield url


def _answer(sock: socket.socket, timeout_s: float) -> bytes:
    """All the server sent until it closed the connection."""
    sock.settimeout(timeout_s)
    try:
        return _read_all(sock)
    finally:
        sock.close()


def _is_408(answer: bytes, says: str) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["code"] == "request_timeout", err
    assert says in err["message"], err


def test_stalled_bodies_are_408_and_closed_while_others_are_served(strict_url):
    socks = []
    for _ in range(STALLED):   # Content-Length 1000, then 30 bytes, then nothing
        sock = _connect(strict_url)
        sock.sendall(_post_head("/v1/completions", 1000) + b'{"prompt": "Hello", "max_tokens"')
        socks.append(sock)
    _serves(strict_url)   # meanwhile
    for sock in socks:
        _is_408(_answer(sock, TOTAL_S + MARGIN_S), "between its parts")
    _serves(strict_url)


def test_a_trickled_body_is_408_after_the_total_bound(strict_url):
    sock = _connect(strict_url)
    t0 = time.monotonic()
    sock.sendall(_post_head("/v1/chat/completions", 1000))
    sock.settimeout(IDLE_S / 4)
    answer, reset = b"", False
    while not answer:   # a byte well within IDLE_S of the last, until the server answers
        assert time.monotonic() < t0 + TOTAL_S + MARGIN_S, "a trickled body was never cut off"
        try:
            sock.sendall(b" ")
            answer = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            # A byte of ours that reached the server after it answered and closed: the kernel resets the connection,
            # and the answer may be lost with it. Still cut off, and not for being idle (we never were).
            reset = True
            break
    assert time.monotonic() - t0 >= TOTAL_S, "cut off before the total bound"
    if not reset:
        _is_408(answer + _answer(sock, MARGIN_S), "in all")
    _serves(strict_url)


def test_stalled_headers_close_the_connection(strict_url):
    socks = [_connect(strict_url) for _ in range(STALLED)]
    for i, sock in enumerate(socks):   # half send part of their headers, half nothing at all
        if i % 2:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Le")
    _serves(strict_url)
    for sock in socks:
        assert _answer(sock, HEADERS_S + MARGIN_S) == b""   # no request began: nothing to answer, only a close
    # A connection kept alive after a response has the same bound on its next request's headers (their first
    # bytes stop uvicorn's keep-alive timeout).
    sock = _connect(strict_url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    first = b""
    while not first.endswith(b"}"):   # /health's JSON
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first
    sock.sendall(b"GET /health HTTP/1.1\r\n")
    assert _answer(sock, HEADERS_S + MARGIN_S) == b""
    _serves(strict_url)


def test_body_timeouts_must_be_positive_and_ordered(llm):
    for idle, total in ((0, 5), (-1, 5), (5, 1), (float("nan"), 5)):
        with pytest.raises(ValueError, match="body timeouts"):
            build_app(llm, body_idle_s=idle, body_total_s=total)


def test_the_replay_debug_server_closes_stalled_headers_too():
    # `replay --debug --port P` serves the /debug routes over a replay's workers: the same bound on headers as serve.
    from types import SimpleNamespace

    from devharness.server.replay_api import ReplayDebugServer
    config = EngineArgs(model="tiny-llama", distributed_executor_backend="uni").create_engine_config()
    server = ReplayDebugServer(SimpleNamespace(config=config, executor=SimpleNamespace(uses_ray=False)), 0,
                               header_timeout_s=HEADERS_S)
    try:
        wait_until(lambda: server.server.started, timeout_s=10)
        sock = _connect(server.url)
        sock.sendall(b"GET /debug/workers HTTP/1.1\r\nHost: te")
        assert _answer(sock, HEADERS_S + MARGIN_S) == b""   # closed, as serve closes it
    finally:
        server.close()
