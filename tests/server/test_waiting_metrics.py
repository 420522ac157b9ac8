"""/metrics' waiting requests by reason and their queue time, under a mixed load: chunked prompts, a KV cache too small
for every request, a max_num_seqs that holds some back, shared prefixes and clients that leave early. At every
scrape the reason series sum to devharness_num_requests_waiting; the queue-time histogram counts every ended request
and its sum is that of the stories' queued_s (GET /debug/requests' figures, read from the engine)."""
import asyncio
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from devharness.engine.request_story import NO_REASON, REASON_CODES
from tests.server import serve_in_thread

PREFIX = "Once upon a time in a land far away there lived a king who "


def scrape(url: str) -> dict:
    """(name, reason) -> value for the metrics this test reads."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, s.labels.get("reason")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith(("devharness_num_requests_waiting",
                                                        "devharness_request_queue_time_seconds"))}


async def load(url: str) -> int:
    """20 requests at once, 4 of them abandoned by their client once their first tokens come; the number sent."""
    async def one(c: httpx.AsyncClient, i: int):
        prompt = (PREFIX if i % 2 else "") + f"request {i} " + "word " * (i * 3 % 20)
        body = {"prompt": prompt, "max_tokens": 12 + i % 5 * 6, "temperature": 0, "ignore_eos": True,
                "stream": i % 5 == 0}
        if not body["stream"]:
            r = await c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return   # leaves: the server aborts it

    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(*(one(c, i) for i in range(20)))
    return 20


def test_waiting_by_reason_sums_to_waiting_and_queue_time_counts_every_request():
    with serve_in_thread("tiny-llama", num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=48,
                         seed=0) as (url, llm, _):
        before = scrape(url)
        assert set(REASON_CODES) | {NO_REASON} == {r for (n, r) in before if n.endswith("_by_reason")}
        scrapes, seen, done = [], set(), threading.Event()

        def scraper():
            while not done.is_set():
                m = scrape(url)
                scrapes.append(m)
                by_reason = {r: v for (n, r), v in m.items() if n == "devharness_num_requests_waiting_by_reason"}
                assert sum(by_reason.values()) == m[("devharness_num_requests_waiting", None)], m
                seen.update(r for r, v in by_reason.items() if v)

        errors = []
        thread = threading.Thread(target=lambda: _catch(scraper, errors), daemon=True)
        thread.start()
        try:
            sent = asyncio.run(load(url))
        finally:
            done.set()
            thread.join(60)
        assert not errors, errors[0]
        assert len(scrapes) >= 3 and seen, "the load never made a request wait"
        assert seen <= set(REASON_CODES) | {NO_REASON} and seen - {NO_REASON}, seen
        after = scrape(url)
        count = after[("devharness_request_queue_time_seconds_count", None)]
        assert count - before.get(("devharness_request_queue_time_seconds_count", None), 0) == sent
        snap = asyncio.run(llm.inspect(lambda engine: engine.requests_snapshot()))
        ended = [r for r in snap.requests if r.state in ("finished", "aborted")]
        assert len(ended) == sent and sum(r.num_preemptions for r in ended) > 0
        queued = after[("devharness_request_queue_time_seconds_sum", None)]
        # The stories' queued_s count to the end (an abandoned request's last wait too): the histogram's to the
        # last admission its client saw.
        assert 0 < queued <= sum(r.queued_s for r in ended) + 1e-3
        assert not snap.stalls, snap.stalls


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:   # the scraper's assertion, reported by the test
        errors.append(e)
