"""One request must never stop the engine, over a tp=2 engine on mp and on Ray, whose workers get every
step as a msgpack message.

- Values the engine cannot carry (integers past 64 bits, NaN / Infinity, lone surrogates) are refused
  at the edge with a 4xx in OpenAI's shape naming the field; after each one /health is 200 and a
  greedy request gives the tokens it gave before.
- A worker error planted in one request's rows (while its inputs are prepared, or while it is
  sampled) fails that request alone, with an OpenAI-shaped error or an SSE error event naming the
  rank, while 8 concurrent requests complete with the tokens tp=1 gives them.
- vLLM's extensions that process the logits (penalties, biases, min_tokens) or score the prompt
  (prompt_logprobs, from logits gathered over the tp ranks) give what tp=1 gives."""
import concurrent.futures
import json

import httpx
import pytest

from devharness import LLM, SamplingParams
from devharness.protocol.messages import ArmRequestFault
from tests.helpers import mixed_prompts
from tests.server import RAY_SERVER_GROUP

MODEL = "tiny-llama"
pytestmark = RAY_SERVER_GROUP
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
          "ignore_eos": True, "return_token_ids": True}
BIG = 2**64      # past every 64-bit integer msgpack can carry
CHAT_HI = '"messages": [{"role": "user", "content": "hi"}]'

# (route, raw JSON body: NaN / Infinity and \ud800 need raw text, field the error must name)
HOSTILE = [
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 4, "seed": {BIG}}}', "seed"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 4, "seed": {2**63}}}', "seed"),
    ("/v1/chat/completions", f'{{{CHAT_HI}, "max_tokens": 4, "seed": {-2**63 - 1}}}', "seed"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 4, "top_k": {BIG}}}', "top_k"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 4, "top_k": {2**63}, "top_p": 0.5}}', "top_k"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 4, "stop_token_ids": [{BIG}]}}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "stop_token_ids": [100000]}', "stop_token_ids"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": {BIG}}}', "max_tokens"),
    ("/v1/chat/completions", f'{{{CHAT_HI}, "max_completion_tokens": {BIG}}}', "max_completion_tokens"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 4, "n": {BIG}}}', "n"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "temperature": Infinity}', "temperature"),
    ("/v1/chat/completions", f'{{{CHAT_HI}, "max_tokens": 4, "top_p": -Infinity}}', "top_p"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "presence_penalty": NaN}', "presence_penalty"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 4, "logit_bias": {{"{2**70}": 1}}}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "logit_bias": {"5": Infinity}}', "logit_bias"),
    ("/v1/completions", f'{{"prompt": [1, {2**70}], "max_tokens": 4}}', "prompt"),
    ("/v1/completions", f'{{"prompt": [1, {-2**70}], "max_tokens": 4}}', "prompt"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "stop": ["x", "\\udfff"]}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "user": "\\ud800"}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 4}', "messages"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}], "max_tokens": 4}',
     "messages"),
]


@pytest.fixture(scope="module")
def server(hostile_server):
    with httpx.Client(base_url=hostile_server[0], timeout=120) as http:
        yield http, greedy_ids(http)


def greedy_ids(http: httpx.Client) -> list[int]:
    r = http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == GREEDY["max_tokens"]
    return choice["token_ids"]


def post_raw(http: httpx.Client, route: str, raw: str) -> httpx.Response:
    return http.post(route, content=raw.encode(), headers={"content-type": "application/json"})


def check_unharmed(http: httpx.Client, expected: list[int]) -> None:
    r = http.get("/health")
    assert r.status_code == 200, r.text
    assert greedy_ids(http) == expected


@pytest.mark.parametrize("route, raw, field", HOSTILE, ids=[f"{i}-{c[2]}" for i, c in enumerate(HOSTILE)])
def test_hostile_request_is_4xx_naming_the_field(server, route, raw, field):
    http, expected = server
    r = post_raw(http, route, raw)
    assert 400 <= r.status_code < 500, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and isinstance(err["code"], str) and err["code"], err
    assert isinstance(err["message"], str) and err["message"], err
    assert (err["param"] or "").startswith(field) or field in err["message"], err
    if "NaN" in raw or "Infinity" in raw:
        assert "finite" in err["message"], err
    if "\\ud" in raw:
        assert "Unicode" in err["message"], err
    check_unharmed(http, expected)


def test_surrogate_keeps_the_keep_alive_connection(server):
    """The refused request and the next one share one TCP connection: the server answered rather
    than dropping it."""
    http, expected = server
    bad = post_raw(http, "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 4}')
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
    good = http.post("/v1/completions", json=GREEDY)
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["token_ids"] == expected

    def local_addr(r):
        return r.extensions["network_stream"].get_extra_info("client_addr")
    assert local_addr(bad) == local_addr(good)


@pytest.mark.parametrize("extra", [
    {"seed": 2**63 - 1, "temperature": 1.0}, {"seed": -2**63, "temperature": 1.0},
    {"top_k": 2**31 - 1, "top_p": 0.5, "temperature": 0.7, "seed": 3},
    {"stop_token_ids": [263]},   # the last id in tiny-llama's vocabulary of 264
], ids=["seed-max", "seed-min", "top_k-max", "stop-last-id"])
def test_boundary_values_run(server, extra):
    """The largest values the schema allows do reach the workers, and the engine takes them."""
    http, expected = server
    r = http.post("/v1/completions", json={**GREEDY, **extra})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) >= 1
    check_unharmed(http, expected)


def test_an_error_message_with_a_lone_surrogate_still_renders():
    """A message that quotes the client's text (a surrogate in it) must not break the response."""
    from devharness.server.errors import error_response as _error
    r = _error(400, "bad text 'a\ud800b'", None, "stop.\udfff")
    body = json.loads(r.body)
    assert body["error"] == {"message": "bad text 'a\\ud800b'", "type": "invalid_request_error",
                             "code": "invalid_request", "param": "stop.\\udfff"}


# -- one request failing inside a worker ---------------------------------------------------------

MAX_TOKENS = 6
PROMPTS = mixed_prompts(9, seed=11)
VICTIM = 4   # the request that fails; the other 8 run beside it


# vLLM's extensions that change the logits the workers sample from, or score the prompt on the output rank.
EXTENSIONS = dict(repetition_penalty=1.4, logit_bias={65: 3.0, 101: -2.0}, min_tokens=4, prompt_logprobs=2)


@pytest.fixture(scope="module")
def tp1():
    """tp=1's greedy tokens of PROMPTS, and its output for one prompt with EXTENSIONS."""
    with LLM("tiny-llama", threads_per_worker=1) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        extended = llm.generate([{"prompt_token_ids": PROMPTS[6]}],
                                SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **EXTENSIONS))[0]
        return [o.outputs[0].token_ids for o in outs], extended


@pytest.fixture(scope="module")
def reference(tp1):
    return tp1[0]


def test_extensions_give_what_tp1_gives(hostile_server, tp1):
    url, _ = hostile_server
    want = tp1[1]
    body = {**isolation_body(PROMPTS[6]), "ignore_eos": False, **EXTENSIONS,
            "logit_bias": {str(t): b for t, b in EXTENSIONS["logit_bias"].items()}}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want.outputs[0].token_ids
    got = choice["prompt_logprobs"]
    assert len(got) == len(PROMPTS[6]) == len(want.prompt_logprobs) and got[0] is None
    for tok, entry, lp in zip(PROMPTS[6][1:], got[1:], want.prompt_logprobs[1:]):
        assert entry[str(tok)]["logprob"] == pytest.approx(lp.token_logprob, abs=1e-4)
        assert entry[str(tok)]["rank"] == lp.token_rank


def isolation_body(prompt, stream=False):
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}


def run_prompt(url, i, request_id, stream):
    headers = {"X-Request-Id": request_id}
    with httpx.Client(base_url=url, timeout=120) as c:
        if not stream:
            r = c.post("/v1/completions", json=isolation_body(PROMPTS[i]), headers=headers)
            return r.status_code, r.json()
        tokens, error = [], None
        with c.stream("POST", "/v1/completions", json=isolation_body(PROMPTS[i], stream=True), headers=headers) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                else:
                    tokens += event["choices"][0].get("token_ids", [])
        return r.status_code, {"error": error} if error else {"choices": [{"token_ids": tokens}]}


@pytest.mark.parametrize("where, stream", [("prepare", False), ("sample", False), ("sample", True)])
def test_planted_error_fails_that_request_alone(hostile_server, reference, where, stream):
    url, llm = hostile_server
    tag = f"{where}-{int(stream)}"
    victim = f"cmpl-victim-{tag}"
    # The planted error: every rank raises while it handles the victim's rows (prepare), or the output
    # rank raises while it samples them.
    assert all(llm.engine.workers.control(ArmRequestFault(victim, where)))
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(run_prompt, url, i, f"victim-{tag}" if i == VICTIM else f"ok{i}-{tag}", stream)
                   for i in range(len(PROMPTS))]
        results = [f.result() for f in futures]
    status, out = results[VICTIM]
    if not stream:
        assert status == 500, out
    err = out["error"]
    assert err["code"] == "request_failed" and err["type"] == "server_error", err
    assert victim in err["message"] and "InjectedFault" in err["message"]
    assert ("rank 0 (tp 0, pp 0)" in err["message"]) and ("sampling" if where == "sample" else "preparing") \
        in err["message"], err
    for i, (status, out) in enumerate(results):
        if i != VICTIM:
            assert status == 200 and out["choices"][0]["token_ids"] == reference[i], (i, out)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    # The victim's prompt runs normally once the fault is gone (the workers dropped it and its blocks).
    status, out = run_prompt(url, VICTIM, f"again-{tag}", stream=False)
    assert status == 200 and out["choices"][0]["token_ids"] == reference[VICTIM]
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0, stats
