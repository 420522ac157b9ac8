"""A served request whose rows hold a planted nan ends alone with a 500 in OpenAI's error shape, naming where the
nan was born; a request beside it and the next one get a clean engine's tokens, and /health stays 200.

The nan is planted in step 2 in the first row of the batch: request A (the shorter prompt, sent first) holds that row
in every step it runs (admitted first, then the shorter decode), so A alone ends, whenever B joins."""
import asyncio

import httpx
import pytest

from devharness import LLM, SamplingParams
from tests.server import serve_in_thread

ENGINE = dict(numerics_check=True, num_kv_blocks=64, seed=0, threads_per_worker=1)
A, B = [1, 2, 3], list(range(20, 44))   # B: longer than A's prompt and output together
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    with serve_in_thread("tiny-llama", inject="nan:layer=1:rank=0:step=2", **ENGINE) as (url, llm, app):
        yield url, llm


@pytest.fixture(scope="module")
def clean():
    with LLM("tiny-llama", distributed_executor_backend="uni", **ENGINE) as llm:
        out = llm.generate({"prompt_token_ids": B}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                   ignore_eos=True))
    return out[0].outputs[0].token_ids


def body(prompt):
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


async def both(url, llm):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        first = asyncio.ensure_future(client.post("/v1/completions", json=body(A)))
        scheduler = llm.engine.core.scheduler
        while not (scheduler.requests or first.done()):   # B only once A is in the engine: A is admitted first
            await asyncio.sleep(0.005)
        second = client.post("/v1/completions", json=body(B))
        return await first, await second


def test_only_the_request_holding_it_fails(server, clean):
    url, llm = server
    a, b = asyncio.run(both(url, llm))
    assert a.status_code == 500, a.text
    err = a.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "non_finite"
    assert err["message"].startswith("non-finite value (nan) born in step 2 on rank 0 (tp 0, pp 0), at layer 1 "
                                     "attention.partial (o_proj), request "), err
    assert b.status_code == 200 and b.json()["choices"][0]["token_ids"] == clean
    assert httpx.get(f"{url}/health").status_code == 200
    after = httpx.post(f"{url}/v1/completions", json=body(B), timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["token_ids"] == clean
    assert httpx.get(f"{url}/health").status_code == 200
