"""Shared by the server tests: a real uvicorn server over an AsyncLLM, in a background thread."""
import contextlib
import socket
import threading
import time

import pytest
import torch
import uvicorn

from devharness.diagnostics.workers import WorkerMonitor
from devharness.engine.args import EngineArgs
from devharness.engine.async_llm import AsyncLLM
from devharness.config import REQUEST_HEADERS_S
from devharness.server.app import build_app, uvicorn_config

# The modules that use tests/server/conftest.py's `shared_ray_server` carry this group: one test process runs them all.
RAY_SERVER_GROUP = pytest.mark.xdist_group("tests/server: tp=2 Ray server")

# Settings of tests/server/conftest.py's servers that their tests hold them to.
# `uni_server` (shared by test_bad_input.py and test_openai_api.py; test_openai_api's reference LLM has the same).
UNI_SERVER = dict(model="tiny-llama", num_kv_blocks=256, seed=0)
# `load_server` (test_load.py): every client's request runs at once (max_num_seqs), in this many KV blocks.
LOAD_CLIENTS, LOAD_KV_BLOCKS = 200, 1024


@contextlib.contextmanager
def serve_in_thread(model: str = "tiny-llama", **llm_kwargs):
    """Yields (base_url, AsyncLLM, app); the server listens on a free loopback port. The test process runs torch
    on one thread meanwhile (a uni worker in it), and on as many as before afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(model=model, **llm_kwargs))
        try:
            monitor = WorkerMonitor(llm.engine) if llm.engine.config.debug.enabled else None
            app = build_app(llm, monitor)
            with serve_app(app) as url:
                yield url, llm, app
        finally:
            llm.shutdown()
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def serve_app(app, header_timeout_s: float = REQUEST_HEADERS_S):
    """Yields the base URL of uvicorn serving `app` on a free loopback port, in a daemon thread, with `serve`'s
    uvicorn settings."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, header_timeout_s, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
