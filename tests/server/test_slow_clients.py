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
from devharness.engine.async_llm import AsyncLLM
from devharness.server.app import build_app
from tests.helpers import wait_until
from tests.server import serve_app

COMPLETION = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(model="tiny-llama", distributed_executor_backend="uni",
                                                           num_kv_blocks=32))
    yield llm
    llm.shutdown()


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
