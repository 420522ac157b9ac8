"""200 concurrent clients mixing streaming and non-streaming completions, streams left mid-way and bad
requests, for a bounded number of requests: every good request gets the tokens it gets alone (greedy),
none hangs, every bad one is a 4xx in OpenAI's shape, the KV cache is all free afterwards, and the
server's and workers' memory stay within 10% of their level after a first (warm-up) round of the same load."""
import asyncio
import re
import gc
import random
import time

import httpx
import psutil

from devharness.bench.load import LoadResult, markdown_blocks, run_load, run_streams
from devharness.protocol.messages import GetNumerics
# The server: tests/server/conftest.py's `load_server`, with these settings.
from tests.server import LOAD_CLIENTS as CLIENTS, LOAD_KV_BLOCKS as KV_BLOCKS

MODEL = "tiny-llama"
MAX_TOKENS = 8
ROUNDS = 2               # requests per client, in the warm-up load and again in the measured one
LOAD_TIMEOUT_S = 120     # the whole load; a request past REQUEST_TIMEOUT_S is a hang
REQUEST_TIMEOUT_S = 60
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(10, 200) for _ in range(_rng.randint(4, 24))] for _ in range(6)]


def baselines(url: str) -> list[list[int]]:
    """Each prompt's greedy tokens, asked alone."""
    out = []
    for p in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def load(url: str, requests_per_client: int):
    return asyncio.run(asyncio.wait_for(
        run_load(url, PROMPTS, clients=CLIENTS, requests_per_client=requests_per_client, max_tokens=MAX_TOKENS,
                 model=MODEL, timeout_s=REQUEST_TIMEOUT_S), LOAD_TIMEOUT_S))


def rss_mb(pids: list[int]) -> list[float]:
    gc.collect()   # the load's own garbage (its clients, its event loop) is no growth of the server's
    return [psutil.Process(pid).memory_info().rss / 2**20 for pid in pids]


def wait_kv_free(llm, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.stats()
        if stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"KV blocks still held after the load: {stats}"
        time.sleep(0.05)


def check(result, expected: list[list[int]]) -> None:
    good = result.of("complete", "stream")
    assert not [o for o in result.outcomes if o.failure], \
        [o for o in result.outcomes if o.failure][:5]
    wrong = [(o.kind, o.prompt, o.token_ids, expected[o.prompt]) for o in good if o.token_ids != expected[o.prompt]]
    assert not wrong, f"{len(wrong)} of {len(good)} good requests differ from their baseline, e.g. {wrong[:3]}"
    left = result.of("disconnect")
    assert left and all(o.status == 200 and 0 < len(o.token_ids) < MAX_TOKENS for o in left), left[:3]
    for o in result.of("bad"):
        assert o.status in (400, 404), o
        err = o.error["error"]
        assert all(isinstance(err[k], str) and err[k] for k in ("message", "type", "code")), o


def test_200_clients_get_their_baseline_tokens_and_leave_nothing_held(load_server):
    url, llm = load_server
    expected = baselines(url)
    pids = [psutil.Process().pid, *getattr(llm.engine.core.executor, "worker_pids", [])]   # uni: in-process
    warm = load(url, requests_per_client=ROUNDS)
    check(warm, expected)
    wait_kv_free(llm)
    warm_mb = rss_mb(pids)

    result = load(url, requests_per_client=ROUNDS)
    check(result, expected)
    assert len(result.of("complete", "stream")) >= CLIENTS   # five good requests in eight
    stats = wait_kv_free(llm)
    assert stats["kv_blocks_total"] == KV_BLOCKS
    after_mb = rss_mb(pids)
    grown = [(pid, round(w), round(a)) for pid, w, a in zip(pids, warm_mb, after_mb) if a > 1.1 * w]
    assert not grown, f"memory past 110% of the warm level (pid, warm MB, after MB): {grown}"
    print(f"load: {result.summary()}; RSS MB warm {[round(m) for m in warm_mb]} after {[round(m) for m in after_mb]}")
    # bench load --markdown's first table says what the summary says.
    m = re.fullmatch(r"(\d+/\d+) good requests completed in (\d+\.\d) s \((\d+\.\d)/s\), latency p50 (\d+) ms, p99 (\d+) ms; "
                     r"(\d+) streams left mid-way; (\d+)/(\d+) bad requests refused with a 4xx", result.summary())
    assert m, result.summary()
    table = markdown_blocks(result, [])[0]
    assert table.header == ["", ""] and table.rows == [
        ["good requests completed", f"{m[1]} in {m[2]} s ({m[3]}/s)"], ["latency p50 / p99", f"{m[4]} ms / {m[5]} ms"],
        ["streams left mid-way / bad requests refused with a 4xx", f"{m[6]} / {m[7]} of {m[8]}"]], table.rows
    # still serving, with the same tokens
    assert baselines(url) == expected
    # The numerics check looked at every step of the workload (on the engine's thread, idle now) and found nothing.
    [numerics] = llm.engine.workers.control(GetNumerics())
    assert numerics.steps and not numerics.alarms, numerics.alarms[:3]


def test_stream_latencies_count_every_token(load_server):
    """bench load's TTFT / inter-token latency sweep measures what was sent: a first-token time per request and an
    inter-token gap per later token (from vLLM's continuous usage stats), at 1 and 4 streams."""
    url, _ = load_server
    for concurrency in (1, 4):
        st = asyncio.run(asyncio.wait_for(run_streams(url, PROMPTS, concurrency=concurrency, requests_per_stream=2,
                                                      max_tokens=MAX_TOKENS, model=MODEL), LOAD_TIMEOUT_S))
        assert st.failures == [] and st.tokens == concurrency * 2 * MAX_TOKENS
        assert len(st.ttft_s) == concurrency * 2 and len(st.itl_s) == concurrency * 2 * (MAX_TOKENS - 1)
        assert all(t > 0 for t in st.ttft_s) and all(t >= 0 for t in st.itl_s)
        assert st.row().split()[:2] == [str(concurrency), str(concurrency * 2)]
        # bench load --markdown's streams table: the row's figures (ITL to 0.1 ms, TTFT and tokens/s to 1).
        cells = markdown_blocks(LoadResult([], 1.0), [st])[1].rows[0]
        text = [float(x) for x in st.row().split()]
        assert cells[:2] == [str(concurrency), str(concurrency * 2)]
        ttft = [float(x) for x in cells[2].split(" / ")]
        assert len(ttft) == 3 and all(abs(a - b) <= 0.55 for a, b in zip(ttft, text[2:5])), (cells, text)
        assert [float(x) for x in cells[3].split(" / ")] == text[5:8], (cells, text)
        assert abs(float(cells[4]) - text[8]) <= 0.5 + 1e-9, (cells, text)
