"""One request's failure stays its own: a worker error planted in one request's rows (while its inputs are
prepared, or while it is sampled) fails that request alone, with an OpenAI-shaped error or an SSE error
event naming the rank, while 8 concurrent requests complete with the tokens tp=1 gives them."""
import concurrent.futures
import json

import httpx
import pytest

from devharness import LLM, SamplingParams
from tests.helpers import mixed_prompts
from tests.server import serve_in_thread

MAX_TOKENS = 6
PROMPTS = mixed_prompts(9, seed=11)
VICTIM = 4   # the request that fails; the other 8 run beside it


@pytest.fixture(scope="module")
def reference():
    with LLM("tiny-llama", threads_per_worker=1) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["mp", "ray"])
def server(request):
    if request.param == "ray":
        request.getfixturevalue("ray_instance")
    with serve_in_thread(tensor_parallel_size=2, distributed_executor_backend=request.param, threads_per_worker=1,
                         num_kv_blocks=128) as (url, llm, _):
        yield url, llm


def body(prompt, stream=False):
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}


def run(url, i, request_id, stream):
    headers = {"X-Request-Id": request_id}
    with httpx.Client(base_url=url, timeout=120) as c:
        if not stream:
            r = c.post("/v1/completions", json=body(PROMPTS[i]), headers=headers)
            return r.status_code, r.json()
        tokens, error = [], None
        with c.stream("POST", "/v1/completions", json=body(PROMPTS[i], stream=True), headers=headers) as r:
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
def test_planted_error_fails_that_request_alone(server, reference, where, stream):
    url, llm = server
    tag = f"{where}-{int(stream)}"
    victim = f"cmpl-victim-{tag}"
    # The planted error: every rank raises while it handles the victim's rows (prepare), or the output
    # rank raises while it samples them.
    assert all(llm.engine.core.executor.collective_rpc("arm_request_fault", (victim, where)))
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(run, url, i, f"victim-{tag}" if i == VICTIM else f"ok{i}-{tag}", stream)
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
    status, out = run(url, VICTIM, f"again-{tag}", stream=False)
    assert status == 200 and out["choices"][0]["token_ids"] == reference[VICTIM]
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0, stats
