"""Limits with clear errors: past --max-pending-requests a new request gets 429 with Retry-After, in
OpenAI's error shape, and the requests already in finish untouched (the engine is held paused so the
first ones stay pending); the limit counts choices (n per prompt), and a request of more choices than it is a
400. What one request may ask for is bounded (config.py's MAX_* limits): past a bound it is a 400 naming the
field, the value and the limit; at the bound it runs, and neither it nor a too-large prompt holds up a
concurrent request or /health. (The body size's 413 and the context length's 400 are in test_bad_input.py.)"""
import asyncio
import concurrent.futures
import random
import threading
import time

import httpx
import pytest

from devharness import config
from devharness.engine.args import EngineArgs
from devharness.engine.async_llm import AsyncLLM
from devharness.server.app import build_app
from tests.helpers import wait_until
from tests.server import serve_app

COMPLETION = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}
# A concurrent short request, or /health, answers within this while a big request runs or a prompt is tokenized
# (one that waited on another request's work took tens of seconds).
CONCURRENT_BOUND_S = 5.0
HEALTH_BOUND_S = 1.5


@pytest.fixture(scope="module")
def llm():
    # Every choice of a 128-choice request runs at once (max_num_seqs, KV blocks), so a concurrent request
    # waits on the engine's work only, not on a queue.
    llm = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(model="tiny-llama", distributed_executor_backend="uni",
                                                           num_kv_blocks=512, max_num_seqs=256,
                                                           threads_per_worker=1))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    """(httpx client, the greedy tokens it gives before any test here)."""
    with serve_app(build_app(llm)) as url, httpx.Client(base_url=url, timeout=120) as http:
        yield http, greedy_ids(http)


def greedy_ids(http: httpx.Client) -> list[int]:
    r = http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def check_unharmed(http: httpx.Client, before: list[int]) -> None:
    assert http.get("/health").status_code == 200
    assert greedy_ids(http) == before


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


# -- what one request may ask for -----------------------------------------------------------------------------

def check_limit_error(r: httpx.Response, param: str, *mentions: str) -> None:
    """A 400 in OpenAI's shape naming the field and saying the value and the limit."""
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["code"] == "invalid_value", err
    assert err["param"] == param, err
    for m in mentions:
        assert m in err["message"], (m, err["message"][:500])


def test_logprobs_past_the_reply_bound_are_refused(server):
    """128 prompts of 2047 tokens, each token's top 20 twice over (echo and prompt_logprobs): some 11 million
    logprobs, a reply of hundreds of megabytes. Refused, naming MAX_LOGPROB_ENTRIES; one such prompt is answered."""
    http, before = server
    prompts = [[random.Random(i).randrange(256) for _ in range(2047)] for i in range(config.MAX_CHOICES)]
    body = {"prompt": prompts, "echo": True, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 0}
    r = http.post("/v1/completions", json=body)
    asked = config.MAX_CHOICES * 2047 * 21 * 2
    check_limit_error(r, "prompt_logprobs", str(asked), str(config.MAX_LOGPROB_ENTRIES), "MAX_LOGPROB_ENTRIES")
    check_unharmed(http, before)
    r = http.post("/v1/completions", json={**body, "prompt": prompts[0]})
    assert r.status_code == 200, r.text[:500]
    choice = r.json()["choices"][0]
    assert len(choice["prompt_logprobs"]) == len(choice["logprobs"]["tokens"]) == 2047
    assert all(len(entry) >= 20 for entry in choice["prompt_logprobs"][1:])
    check_unharmed(http, before)


STOP_3 = [f"{i:03x}" for i in range(330_000)]   # 330,000 three-character stop strings (about 2 MB of JSON)


@pytest.mark.parametrize("extra, param, mentions", [
    ({"n": 32, "stop": STOP_3}, "stop", ["330000", str(config.MAX_STOP_STRINGS)]),
    ({"n": 128, "max_tokens": 20, "ignore_eos": True, "stop": STOP_3}, "stop",
     ["330000", str(config.MAX_STOP_STRINGS)]),
    ({"stop": ["x" * (config.MAX_STOP_STRING_CHARS + 1)]}, "stop.0", [str(config.MAX_STOP_STRING_CHARS)]),
    ({"stop": ["y" * config.MAX_STOP_STRING_CHARS] * (config.MAX_STOP_TOTAL_CHARS // config.MAX_STOP_STRING_CHARS + 1)},
     "stop", [str(config.MAX_STOP_TOTAL_CHARS), "MAX_STOP_TOTAL_CHARS"]),
    ({"stop_token_ids": [1] * (config.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", [str(config.MAX_STOP_TOKEN_IDS)]),
    ({"logit_bias": {str(i): 1 for i in range(config.MAX_LOGIT_BIAS + 1)}}, "logit_bias",
     [str(config.MAX_LOGIT_BIAS)]),
    ({"prompt": ["a"] * (config.MAX_CHOICES + 1)}, "prompt", [str(config.MAX_CHOICES)]),
    ({"logprobs": config.MAX_LOGPROBS + 1}, "logprobs", [str(config.MAX_LOGPROBS)]),
    ({"n": 128, "max_tokens": 2000, "logprobs": 20}, "logprobs", [str(config.MAX_LOGPROB_ENTRIES)]),
], ids=["stop-count", "stop-count-n128", "stop-length", "stop-total", "stop_token_ids", "logit_bias", "prompts",
        "logprobs", "logprob-entries"])
def test_past_a_bound_is_400_naming_it(server, extra, param, mentions):
    http, before = server
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, **extra})
    check_limit_error(r, param, *mentions)
    check_unharmed(http, before)


def test_chat_logprobs_past_the_reply_bound_are_refused(server):
    """Chat's max_tokens defaults to the rest of the context: with 128 choices and top 20 that is past the bound."""
    http, before = server
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 128,
                                                "logprobs": True, "top_logprobs": 20})
    check_limit_error(r, "top_logprobs", str(config.MAX_LOGPROB_ENTRIES))
    check_unharmed(http, before)


def biggest_stop_list(rng: random.Random) -> list[str]:
    """MAX_STOP_STRINGS stop strings of every length up to MAX_STOP_STRING_CHARS (so the matcher has every length
    to look for), within MAX_STOP_TOTAL_CHARS."""
    lengths = list(range(1, config.MAX_STOP_STRING_CHARS + 1))
    lengths += [1] * (config.MAX_STOP_STRINGS - len(lengths))
    budget = config.MAX_STOP_TOTAL_CHARS - sum(lengths)
    assert budget >= 0
    # "\x7f" and "~" lead every string: text the model may write, but hardly in this order, so they rarely match.
    stops = ["\x7f~"[:n] + "".join(rng.choices("\x7f~", k=max(n - 2, 0))) for n in lengths]
    assert len(stops) == config.MAX_STOP_STRINGS and sum(map(len, stops)) <= config.MAX_STOP_TOTAL_CHARS
    return stops


def test_the_biggest_stop_list_allowed_does_not_hold_up_other_requests(server, llm):
    """n=128 choices of 20 tokens each, with the most stop strings allowed, every length up to the longest: a
    concurrent 16-token request finishes within CONCURRENT_BOUND_S while it runs (it took a minute with 330,000
    stop strings scanned at every token), and every choice's text is what a scan of every stop string allows."""
    http, before = server
    stops = biggest_stop_list(random.Random(0))
    big = {"prompt": "Hi", "n": 128, "max_tokens": 20, "ignore_eos": True, "stop": stops, "seed": 1}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(http.post, "/v1/completions", json=big)
        deadline = time.monotonic() + 60
        while llm.num_requests < 128:
            assert time.monotonic() < deadline and not running.done(), "the big request never reached the engine"
            time.sleep(0.01)
        t0 = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 16, "ignore_eos": True})
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
        assert not running.done() or took < CONCURRENT_BOUND_S   # it overlapped the big one
        big_r = running.result(timeout=120)
    assert took < CONCURRENT_BOUND_S, f"a 16-token request took {took:.1f} s beside a 128-choice one"
    assert big_r.status_code == 200, big_r.text[:500]
    choices = big_r.json()["choices"]
    assert len(choices) == 128
    for c in choices:
        text = c["text"]
        # no stop string within the text; a choice cut short ends at a stop string
        assert not any(s in text for s in stops), text
        assert c["finish_reason"] in ("length", "stop")
    check_unharmed(http, before)


def test_a_whole_vocabulary_bias_at_n_128_is_applied(server):
    """Every token of tiny-llama's 264 biased, one far above the rest: 128 choices, sampled, all write it."""
    http, before = server
    bias = {str(t): -50.0 + (t % 7) for t in range(264)}
    bias["65"] = 100.0
    r = http.post("/v1/completions", json={"prompt": "Hi", "n": 128, "max_tokens": 5, "ignore_eos": True,
                                           "logit_bias": bias, "return_token_ids": True})
    assert r.status_code == 200, r.text[:500]
    assert [c["token_ids"] for c in r.json()["choices"]] == [[65] * 5] * 128
    check_unharmed(http, before)


def test_health_answers_while_a_too_long_prompt_is_tokenized(server):
    """A prompt of 4 million characters (under the 4 MiB body limit) takes seconds to tokenize: meanwhile /health
    answers within HEALTH_BOUND_S each time, then the prompt is a 400 context_length_exceeded."""
    http, before = server
    body = {"prompt": "hello world " * 330_000, "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(http.post, "/v1/completions", json=body)
        waits = []
        while not refused.done():
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
        r = refused.result()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:500]
    assert len(waits) >= 3, waits   # the health checks did run while the prompt was worked on
    assert max(waits) < HEALTH_BOUND_S, waits
    check_unharmed(http, before)
