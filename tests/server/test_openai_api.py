"""The OpenAI-compatible server, driven by the `openai` client: token-exact with LLM.generate,
streaming, concurrency, client disconnects, and the `devharness serve` CLI's lifecycle."""
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devharness import LLM, SamplingParams
from devharness.engine.args import EngineArgs
from devharness.engine.async_llm import AsyncLLM
from tests.server import UNI_SERVER, serve_in_thread

MODEL = UNI_SERVER["model"]
PROMPT = "The capital of France is"
EXTRA = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(uni_server):
    url, _, _ = uni_server
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """An LLM with the settings of the server (tests/server/conftest.py's `uni_server`, which test_bad_input.py
    shares: its tests leave it as they found it, and so do this module's)."""
    with LLM(**UNI_SERVER) as llm:
        yield llm


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_completion_is_token_exact_with_llm_generate(client, reference):
    want = reference.generate(PROMPT, greedy(12))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=EXTRA)
    choice = r.choices[0]
    assert choice.text == want.outputs[0].text
    assert choice.token_ids == want.outputs[0].token_ids
    assert choice.prompt_token_ids == want.prompt_token_ids
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    assert r.model == MODEL and r.object == "text_completion"


def test_completion_from_token_ids_with_logprobs(client, reference):
    ids = [256, 72, 105, 33, 10]
    want = reference.generate({"prompt_token_ids": ids}, greedy(6))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=2, extra_body=EXTRA)
    choice = r.choices[0]
    assert choice.token_ids == want.token_ids and choice.text == want.text
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 6
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)
    # Greedy: each chosen token is the most likely one.
    assert all(lp == pytest.approx(max(top.values())) for lp, top in
               zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs))


def test_completion_stream_matches_non_stream(client, reference):
    want = reference.generate(PROMPT, greedy(10))[0].outputs[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=EXTRA))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert text == want.text and ids == want.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_completion_and_stream(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    want = reference.chat(messages, greedy(8))[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=EXTRA)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.choices[0].token_ids == want.outputs[0].token_ids
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 8

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body=EXTRA))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sixteen_concurrent_streams(uni_server, reference):
    url, _, _ = uni_server
    prompts = [f"Request number {i} says" + "!" * i for i in range(16)]
    want = [o.outputs[0] for o in reference.generate(prompts, greedy(8))]

    async def one(c, prompt):
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            extra_body=EXTRA)
        text, ids = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            ids += chunk.choices[0].token_ids
        return text, ids

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(main())
    assert got == [(w.text, w.token_ids) for w in want]


def _metric(url: str, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


def test_client_disconnect_aborts_and_frees_kv(uni_server):
    url, llm, _ = uni_server
    aborted_before = _metric(url, "devharness_request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()   # held: dropping it would close the connection right here
            assert next(line for line in lines if line.startswith("data:"))
            # Hold the engine so the request is surely still running (and holding KV blocks) when we leave.
            asyncio.run(llm.pause())
            assert llm.stats()["kv_blocks_used"] > 0 and llm.stats()["num_requests"] == 1
        # Aborts are applied between steps, also while paused.
        deadline = time.monotonic() + 30
        while llm.stats()["num_requests"] or llm.stats()["kv_blocks_used"]:
            assert time.monotonic() < deadline, f"request not aborted: {llm.stats()}"
            time.sleep(0.05)
    finally:
        asyncio.run(llm.resume())
    assert _metric(url, "devharness_kv_cache_blocks_used") == 0
    assert _metric(url, "devharness_request_success_total", finished_reason="abort") == aborted_before + 1


def test_non_streaming_client_disconnect_aborts(uni_server):
    url, llm, _ = uni_server
    aborted_before = _metric(url, "devharness_request_success_total", finished_reason="abort")
    body = json.dumps({"prompt": "Hi", "max_tokens": 2000, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while not llm.stats()["num_running"]:
            assert time.monotonic() < deadline, llm.stats()
            time.sleep(0.01)
    deadline = time.monotonic() + 30
    while llm.stats()["num_requests"] or llm.stats()["kv_blocks_used"]:
        assert time.monotonic() < deadline, f"request not aborted: {llm.stats()}"
        time.sleep(0.02)
    assert _metric(url, "devharness_request_success_total", finished_reason="abort") == aborted_before + 1


def test_models_health_metrics(uni_server, client):
    url, _, _ = uni_server
    assert [m.id for m in client.models.list().data] == [MODEL]
    # A request of its own, ended by its length, so that the figures below do not depend on the tests before it.
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0,
                                     extra_body=EXTRA).choices[0].finish_reason == "length"
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in ("devharness_request_success_total", "devharness_prompt_tokens_total",
                 "devharness_generation_tokens_total", "devharness_engine_step_seconds_bucket",
                 "devharness_num_requests_running", "devharness_num_requests_waiting",
                 "devharness_kv_cache_usage_perc"):
        assert name in text
    assert _metric(url, "devharness_engine_step_seconds_count") > 0
    assert _metric(url, "devharness_request_success_total", finished_reason="length") > 0


def test_health_is_503_when_the_engine_is_dead():
    with serve_in_thread(MODEL, num_kv_blocks=16) as (url, llm, _):
        def broken_step(*a):
            raise RuntimeError("rank 0 died (simulated)")
        # Swapped before any request, so the engine thread only ever sees the broken executor.
        llm.engine.core.executor.execute_model = broken_step
        llm.engine.core.executor.check_health = broken_step
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "rank 0 died" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=30).status_code == 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


# -- AsyncLLM hooks ---------------------------------------------------------------------------------

async def wait_for(condition, llm, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, llm.stats()
        await asyncio.sleep(0.02)


async def test_pause_resume_step_once():
    llm = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, num_kv_blocks=64))
    try:
        await llm.pause()
        steps = llm.stats()["steps_run"]
        stream = llm.add_request({"prompt_token_ids": [1, 2, 3]}, greedy(5), "r1")
        await wait_for(lambda: llm.stats()["num_waiting"] == 1, llm)   # queued, not lost
        await asyncio.sleep(0.1)
        assert llm.stats()["steps_run"] == steps and llm.stats()["num_waiting"] == 1
        got = []
        for i in range(3):
            stats = await llm.step_once()
            assert stats["steps_run"] == steps + i + 1 and stats["paused"]
            got.append(await asyncio.wait_for(stream.__anext__(), 30))
        assert [len(o.outputs[0].token_ids) for o in got] == [1, 2, 3]
        stats = await llm.step_once(2)
        assert stats["steps_run"] == steps + 5
        got += [await asyncio.wait_for(stream.__anext__(), 30) for _ in range(2)]
        assert got[-1].finished and len(got[-1].outputs[0].token_ids) == 5
        await llm.resume()
        outs = [o async for o in llm.generate({"prompt_token_ids": [4, 5]}, greedy(3), "r2")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        with pytest.raises(ValueError):
            await llm.step_once(0)
    finally:
        llm.shutdown()


async def test_generate_validates_before_streaming_and_cancel_aborts():
    llm = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, num_kv_blocks=64))
    try:
        with pytest.raises(ValueError, match="prompt"):
            llm.add_request("", greedy(3), "bad")
        gen = llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(1000), "long")
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()   # what a client disconnect does to the server's iterator
        await wait_for(lambda: not llm.stats()["kv_blocks_used"] and not llm.stats()["num_running"], llm)
    finally:
        llm.shutdown()
    with pytest.raises(Exception, match="shut down"):
        llm.add_request({"prompt_token_ids": [1]}, greedy(1), "late")


# -- the CLI --------------------------------------------------------------------------------------

def _serve_cmd(*args) -> list[str]:
    exe = shutil.which("devharness")
    return [exe, "serve", *args] if exe else [sys.executable, "-m", "devharness.cli", "serve", *args]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_devharness_serve_cli_ends_inflight_requests_and_exits_on_signal(sig):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_serve_cmd("--model", MODEL, "--port", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines, url = [], None
        deadline = time.monotonic() + 120
        while url is None:
            assert time.monotonic() < deadline, lines
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"serve exited early: {lines}"
            lines.append(line)
            m = re.search(r"serving \S+ at (http://\S+)", line)
            url = m and m.group(1)
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        body = {"prompt": "Hi", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            events = r.iter_lines()
            assert next(e for e in events if e.startswith("data:"))
            proc.send_signal(sig)
            rest = [e for e in events if e.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2] and '"error"' in rest[-2]
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "Traceback" not in out and "server stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_devharness_serve_busy_port_is_a_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(_serve_cmd("--port", str(port)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr
