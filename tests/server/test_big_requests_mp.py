"""The requests that once broke an mp tp=2 x pp=2 server for good (a step message past the shared-memory ring's
size, which timed out half-written and left the channel unusable): past a bound they are a 400 naming it; at the
bounds they are answered, with tp=1's tokens; either way /health stays 200 and a greedy request's text is unchanged.
(The ring itself, with a reader made slow on purpose: tests/distributed/test_shm_ring.py, tests/executor/test_mp.py.)"""
import httpx
import pytest

from devharness import LLM, SamplingParams, config
from tests.server import serve_in_thread

GREEDY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}
VOCAB = 264   # tiny-llama's
# Every token biased, one far above the rest: a choice that honours the bias writes it.
BIAS = {str(t): -10.0 + (t % 5) for t in range(VOCAB)}
BIAS["65"] = 40.0
# At the bounds: the most choices a request may ask for, each with a bias on every token (sent to every worker in
# the step message), sampled with a seed of their own (the same tokens on any layout).
AT_BOUNDS = {"prompt": "Hi", "n": config.MAX_CHOICES, "max_tokens": 4, "temperature": 1.0, "seed": 7,
             "ignore_eos": True, "logit_bias": BIAS, "return_token_ids": True}


@pytest.fixture(scope="module")
def reference():
    """tp=1's greedy tokens for GREEDY, and each choice's tokens for AT_BOUNDS."""
    with LLM("tiny-llama", threads_per_worker=1, seed=0) as llm:
        greedy = llm.generate([GREEDY["prompt"]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        # The server gives choice j of a seeded request the seed seed + j (vLLM's rule).
        params = [SamplingParams(max_tokens=4, temperature=1.0, seed=7 + j, ignore_eos=True,
                                 logit_bias={int(t): b for t, b in BIAS.items()}) for j in range(config.MAX_CHOICES)]
        at_bounds = [o.outputs[0] for o in llm.generate([AT_BOUNDS["prompt"]] * config.MAX_CHOICES, params)]
    return greedy[0].outputs[0].token_ids, sorted(o.token_ids for o in at_bounds)


@pytest.fixture(scope="module")
def server():
    with serve_in_thread("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2,
                         distributed_executor_backend="mp", threads_per_worker=1, num_kv_blocks=256,
                         max_num_seqs=256, seed=0) as (url, llm, _), httpx.Client(base_url=url, timeout=300) as http:
        yield http


def unharmed(http: httpx.Client, greedy: list[int]) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy, r.text


@pytest.mark.parametrize("body, param", [
    # n=128 with a bias on every id of a 49152-token vocabulary (677 KB): past MAX_LOGIT_BIAS
    ({"prompt": "Hi", "n": 128, "max_tokens": 4, "temperature": 1.0,
      "logit_bias": {str(i): 0.5 for i in range(49152)}}, "logit_bias"),
    # n=32 with 330,000 three-character stop strings (3.6 MB): past MAX_STOP_STRINGS
    ({"prompt": "Hi", "n": 32, "max_tokens": 8, "stop": [f"{i:03x}" for i in range(330_000)]}, "stop"),
], ids=["logit-bias-n128", "stop-list-n32"])
def test_what_broke_the_channel_is_a_400_naming_the_bound(server, reference, body, param):
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text[:500]
    assert r.json()["error"]["param"] == param, r.text[:500]
    unharmed(server, reference[0])


def test_a_request_at_the_bounds_gets_tp1s_tokens(server, reference):
    r = server.post("/v1/completions", json=AT_BOUNDS)
    assert r.status_code == 200, r.text[:500]
    choices = r.json()["choices"]
    assert len(choices) == config.MAX_CHOICES
    assert sorted(c["token_ids"] for c in choices) == reference[1]
    assert sum(c["token_ids"].count(65) for c in choices) > 3 * len(choices)   # the bias was applied
    unharmed(server, reference[0])
