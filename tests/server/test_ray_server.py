"""The OpenAI server over a tp=2 Ray engine: many concurrent streams give LLM.generate's tokens,
and /metrics shows each worker's last step time and liveness, read from its published state."""
import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


from devharness import LLM, SamplingParams  # noqa: E402
from tests.helpers import mixed_prompts  # noqa: E402
from tests.server import RAY_SERVER_GROUP  # noqa: E402

MODEL = "tiny-llama"
pytestmark = RAY_SERVER_GROUP
MAX_TOKENS = 8
NUM_STREAMS = 64
# Fewer blocks than 64 mixed prompts need at once (~3 each), so the scheduler also queues some
# requests behind others: a waiting stream must still end with the right tokens.
NUM_KV_BLOCKS = 128
EXTRA = {"return_token_ids": True, "ignore_eos": True}

# Half token ids of mixed lengths (crossing block boundaries), half text through the tokenizer.
PROMPTS = [p if i % 2 else f"Stream {i} asks about " + "the weather " * (i % 7)
           for i, p in enumerate(mixed_prompts(NUM_STREAMS, seed=1))]


@pytest.fixture(scope="module")
def server(ray_instance, shared_ray_server):
    """The tp=2 Ray server tests/server/conftest.py shares (tiny-llama, NUM_KV_BLOCKS blocks, seed 0)."""
    url, llm, app = shared_ray_server()
    cfg = llm.engine.config
    assert (cfg.scheduler.num_kv_blocks, cfg.parallel.tensor_parallel_size, cfg.model.seed) == (NUM_KV_BLOCKS, 2, 0)
    return url, llm, app


@pytest.fixture(scope="module")
def reference():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in PROMPTS]
    with LLM(MODEL, distributed_executor_backend="uni", threads_per_worker=1, seed=0) as llm:
        return [(o.outputs[0].text, o.outputs[0].token_ids) for o in llm.generate(inputs, params)]


async def _stream(client: openai.AsyncOpenAI, prompt) -> tuple[str, list[int], str | None]:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body=EXTRA)
    text, ids, finish = "", [], None
    async for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        ids += choice.token_ids
        finish = choice.finish_reason or finish
    return text, ids, finish


def test_64_concurrent_streams_match_llm_generate(server, reference):
    url, _, _ = server

    async def main():
        # One connection per stream, so all 64 are in flight at once rather than queued in the client.
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120,
                                      http_client=httpx.AsyncClient(limits=limits)) as client:
            # Generous: 2 shared CPUs; a hang fails here rather than at pytest's global timeout.
            return await asyncio.wait_for(asyncio.gather(*(_stream(client, p) for p in PROMPTS)), 300)

    got = asyncio.run(main())
    assert [g[2] for g in got] == ["length"] * NUM_STREAMS
    mismatched = [i for i, (g, want) in enumerate(zip(got, reference)) if g[:2] != want]
    assert not mismatched, [(i, got[i][:2], reference[i]) for i in mismatched[:3]]


def _samples(url: str, name: str) -> dict[str, tuple[dict, float]]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.labels["rank"]: (s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


def test_metrics_show_each_workers_step_time(server):
    url, llm, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    assert not llm.engine.config.debug.enabled   # workers publish their state in every mode

    step_ms = _samples(url, "devharness_worker_last_step_ms")
    assert sorted(step_ms) == ["0", "1"]
    for rank, (labels, value) in step_ms.items():
        assert (labels["tp_rank"], labels["pp_rank"]) == (rank, "0")
        assert labels["model_name"] == MODEL
        assert value > 0
    alive = _samples(url, "devharness_worker_alive")
    assert {rank: v for rank, (_, v) in alive.items()} == {"0": 1.0, "1": 1.0}
