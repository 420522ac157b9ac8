"""Each request's story at tp=2 x pp=2 (mp workers, two batches in flight): the batch queue holds requests back
through the real engine, and the planted scheduler faults (sched-strand, sched-thrash) are named within their K steps,
the stall naming the request the fault picked (its warning says which)."""
import json
import logging
import re
from pathlib import Path

import pytest

from devharness import LLM, SamplingParams
from devharness.debug import faults, sched_faults

pytestmark = pytest.mark.timeout(300)

K_STEPS, K_PREEMPTIONS = 6, 3


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def drain(engine, limit: int = 200) -> None:
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError(f"requests left after {limit} steps: {engine.unfinished_request_ids()}")


def picked(caplog, kind: str, verb: str) -> tuple[int, str]:
    m = re.search(rf"planted {kind}: from step (\d+) the scheduler {verb} request ([^\s,]+)", caplog.text)
    assert m, caplog.text
    return int(m.group(1)), m.group(2)


def test_batch_queue_and_planted_faults_at_tp2_pp2(caplog, tmp_path):
    with caplog.at_level(logging.WARNING), LLM("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2,
                                               distributed_executor_backend="mp", threads_per_worker=1,
                                               stall_steps=K_STEPS, stall_preemptions=K_PREEMPTIONS,
                                               bundle_dir=str(tmp_path)) as llm:
        engine = llm.engine
        sched = engine.core.scheduler
        assert sched.max_concurrent_batches == 2 and type(engine.workers).__name__ == "MultiprocExecutor"
        assert engine.config.parallel.world_size == 4

        # The batch queue: the first batch takes its share (half), the rest wait for the next batch; with a batch in
        # flight and one slot allowed, no step is scheduled and the waiting requests are told every slot is taken.
        for i in range(6):
            engine.add_request({"prompt_token_ids": [5 + i, 6, 7, 8, 9]}, params(4), f"b{i}")
        engine.step()
        held = [engine.request_story(r.req_id).waiting_reason for r in sched.waiting]
        assert len(held) == 3 and all(w.code == "batch-queue" and "its share" in w.detail for w in held), held
        assert engine.stats()["num_waiting_by_reason"]["batch-queue"] == 3
        engine.step(max_in_flight=1)
        told = engine.request_story(sched.waiting[0].req_id).waiting_reason
        assert told.code == "batch-queue" and "every batch slot is in flight (1 of 2)" in told.detail, told
        drain(engine)
        assert not engine.requests_snapshot().stalls

        # sched-strand: one request arrives each step; the one the fault picks never runs.
        sched_faults.install(faults.parse(f"sched-strand:step={sched.step_count + 2}"), sched)
        for n in range(K_STEPS * 3 + 8):
            engine.add_request({"prompt_token_ids": [40 + n, 6, 7, 8]}, params(3), f"s{n}")
            engine.step()
            if engine.requests_snapshot().stalls:
                break
        first, rid = picked(caplog, "sched-strand", "skips")
        stall, = engine.requests_snapshot().stalls
        assert (stall.kind, stall.request_id, stall.reason, stall.steps) == ("passed-over", rid, "fits", K_STEPS)
        assert stall.step - first + 1 <= K_STEPS + 2   # the pass that picked it may have been one that made no step
        story = engine.request_story(rid)
        assert story.state == "waiting" and story.num_output_tokens == 0
        # Where users look: the engine's stats (the TUI's hang view) while it holds, and a bundle's requests.json.
        assert [s for s in engine.stats()["stalls"] if s.startswith(f"request {rid} passed-over:")]
        bundle = json.loads((Path(llm.runner.write_bundle()) / "requests.json").read_text())
        assert [(s["kind"], s["request_id"]) for s in bundle["stalls"]] == [("passed-over", rid)]
        told = next(r for r in bundle["requests"] if r["request_id"] == rid)
        assert told["state"] == "waiting" and told["events"][0]["kind"] == "arrive"
        assert told["events"][-1]["kind"] == "wait" and told["events"][-1]["count"] >= K_STEPS
        assert "no reason held it" in told["events"][-1]["detail"]
        del sched._schedule   # the fault out: the class's pass again
        engine.abort_request(rid)
        drain(engine)
        assert not engine.stats()["stalls"]   # no longer holds: its request ended

        # sched-thrash: the oldest running request is preempted at every pass that finds it back from its step.
        for i in range(3):
            engine.add_request({"prompt_token_ids": [90 + i, 6, 7, 8, 9, 10]}, params(200), f"t{i}")
        engine.step()
        sched_faults.install(faults.parse(f"sched-thrash:step={sched.step_count + 1}"), sched)
        for _ in range(8 * (K_PREEMPTIONS + 1)):
            engine.step()
            if len(engine.requests_snapshot().stalls) > 1:
                break
        first, rid = picked(caplog, "sched-thrash", "preempts")
        thrash = engine.requests_snapshot().stalls[-1]
        assert (thrash.kind, thrash.request_id, thrash.steps) == ("thrash", rid, K_PREEMPTIONS + 1)
        # A preemption at every pass its step is back from: at pp=2, at least every other step.
        assert thrash.step - first < 2 * (K_PREEMPTIONS + 1) + 2, (first, thrash)
        preempts = [e for e in engine.request_story(rid).events if e.kind == "preempt"]
        assert len(preempts) == K_PREEMPTIONS + 1 and all("planted sched-thrash" in e.detail for e in preempts)
        del sched._schedule
        engine.abort_all_requests()
