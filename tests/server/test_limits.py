"""Limits with clear errors: past --max-pending-requests a new request gets 429 with Retry-After, in
OpenAI's error shape, and the requests already in finish untouched. The engine is held paused so the
first ones stay pending. (The body size's 413 and the context length's 400 are in test_bad_input.py.)"""
import asyncio
import threading
import time

import httpx
import pytest

from devharness.engine.args import EngineArgs
from devharness.engine.async_llm import AsyncLLM
from devharness.server.app import build_app
from tests.server import serve_app

COMPLETION = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(model="tiny-llama", distributed_executor_backend="uni",
                                                           num_kv_blocks=32))
    yield llm
    llm.shutdown()


def test_past_max_pending_requests_is_429_and_those_in_flight_finish(llm):
    with serve_app(build_app(llm, max_pending_requests=2)) as url:
        asyncio.run(llm.pause())
        held: list[httpx.Response] = []
        bodies = [COMPLETION, {**COMPLETION, "stream": True}]
        threads = [threading.Thread(target=lambda b=b: held.append(httpx.post(f"{url}/v1/completions", json=b,
                                                                             timeout=60))) for b in bodies]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while llm.num_requests < 2:
                assert time.monotonic() < deadline, "the held requests never reached the engine"
                time.sleep(0.02)
            for route, body in (("/v1/completions", COMPLETION), ("/v1/completions", bodies[1]),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
                r = httpx.post(url + route, json=body, timeout=30)
                assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
                err = r.json()["error"]
                assert set(err) == {"message", "type", "code", "param"}
                assert err["code"] == "too_many_pending_requests" and "--max-pending-requests" in err["message"]
            assert httpx.get(f"{url}/v1/models").status_code == 200   # only new requests are refused
        finally:
            asyncio.run(llm.resume())
            for t in threads:
                t.join(60)
        assert sorted(r.status_code for r in held) == [200, 200]
        assert any(r.json()["choices"][0]["finish_reason"] == "length" for r in held
                   if r.headers["content-type"].startswith("application/json"))
        assert any("data: [DONE]" in r.text for r in held)
        assert httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60).status_code == 200


def test_max_pending_requests_must_be_positive(llm):
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="--max-pending-requests"):
            build_app(llm, max_pending_requests=bad)
