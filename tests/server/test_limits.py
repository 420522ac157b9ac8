"""Limits with clear errors: past --max-pending-requests a new request gets 429 with Retry-After, in
OpenAI's error shape, and the requests already in finish untouched; the limit counts choices (n per prompt),
and a request of more choices than it is a 400. The engine is held paused so the first ones stay pending.
(The body size's 413 and the context length's 400 are in test_bad_input.py.)"""
import asyncio
import threading
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


def test_max_pending_requests_counts_choices(llm):
    """n=3 fills a limit of 4 where n=1 would leave room; a request of more choices than the limit can never fit
    and is a 400 naming the flag, not a 429 that invites retrying."""
    with serve_app(build_app(llm, max_pending_requests=4)) as url:
        for body, param in (({**COMPLETION, "n": 5}, "n"),
                            ({**COMPLETION, "prompt": ["a", "b", "c"], "n": 2}, "prompt")):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "--max-pending-requests 4" in err["message"], err
        asyncio.run(llm.pause())
        held: list[httpx.Response] = []

        def hold(body):
            thread = threading.Thread(target=lambda: held.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                           timeout=60)))
            thread.start()
            return thread

        threads = []
        try:
            threads.append(hold({**COMPLETION, "n": 3}))
            wait_until(lambda: llm.num_requests == 3, 30, "the n=3 request's choices in the engine")
            # 3 + 3 > 4, where counting requests (1 held) would have let it in
            for route, body in (("/v1/completions", {**COMPLETION, "n": 3}),
                                ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2})):
                r = httpx.post(url + route, json=body, timeout=30)
                assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
                assert "--max-pending-requests 4" in r.json()["error"]["message"]
            threads.append(hold(COMPLETION))   # 3 + 1 fits
            wait_until(lambda: llm.num_requests == 4, 30, "the n=1 request in the engine")
            assert httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30).status_code == 429
        finally:
            asyncio.run(llm.resume())
            for t in threads:
                t.join(60)
        assert [len(r.json()["choices"]) for r in sorted(held, key=lambda r: len(r.json()["choices"]))] == [1, 3]
        assert httpx.post(f"{url}/v1/completions", json={**COMPLETION, "n": 4}, timeout=60).status_code == 200
