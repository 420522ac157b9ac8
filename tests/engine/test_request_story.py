"""Each request's story (engine/request_story.py) and its waiting reasons, against a recount.

The scheduler is driven step by step with a stand-in for the workers (one token sampled wherever a request's
scheduled tokens reach its end). After each scheduling pass, before the output comes back, every waiting request's
reason and the numbers in its detail are checked against what the test reads itself at that moment: the KV map
(Scheduler.kv_snapshot, as GET /debug/kv serves it), the step message and the config. Loads starve the KV cache, fill
max_num_seqs, spend the token budget on a long chunked prompt and fill the batch queue; the planted scheduler bugs
are named by the stall detector within its K steps."""
import logging
import math
import re

from devharness import LLM, SamplingParams
from devharness.config import SchedulerConfig
from devharness.debug import faults, sched_faults
from devharness.engine.request import Request, RequestStatus
from devharness.config import STALL_PREEMPTIONS
from devharness.engine.request_story import REASON_CODES
from devharness.engine.scheduler import Scheduler
from devharness.protocol.messages import ModelRunnerOutput

BLOCK = 16


def request(rid: str, n: int, max_tokens: int = 8, seed: int = 0) -> Request:
    ids = [(7 * seed + 3 * j) % 240 + 5 for j in range(n)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), 0, (), 4096)


def scheduler(num_blocks: int = 256, mcb: int = 1, **cfg) -> Scheduler:
    cfg = {"block_size": BLOCK, "enable_prefix_caching": False, **cfg}
    return Scheduler(SchedulerConfig(**cfg), num_blocks, mcb)


def finish_step(sched: Scheduler, so) -> None:
    """The workers' part: a token for every request whose scheduled tokens reach its end."""
    ids = [rid for rid, n in so.num_scheduled_tokens.items()
           if (r := sched.requests.get(rid)) is not None and r.num_computed_tokens + n >= r.num_tokens]
    sched.update_from_output(so, ModelRunnerOutput(ids, [11] * len(ids)))


def recount(sched: Scheduler, so, seen: set) -> None:
    """Every waiting request's reason against the KV map, the step message and the config, read now."""
    kv = sched.kv_snapshot()
    cfg = sched.config
    budget = math.ceil(cfg.max_num_batched_tokens / sched.max_concurrent_batches)
    spent = sum(so.num_scheduled_tokens.values())
    waiting = list(sched.waiting)
    for i, req in enumerate(waiting):
        story = sched.stories.story(req.req_id, paused=False)
        reason = story.waiting_reason
        assert reason is not None and reason.code in REASON_CODES, (req.req_id, reason)
        code, detail = reason.code, reason.detail
        seen.add(code)
        if code == "kv-blocks":
            free = int(re.search(r"(\d+) free", detail).group(1))
            assert free == kv.num_free
            if "preempted" in detail:   # a step that preempted admits no one: every waiting request is told so
                assert any(e.kind == "preempt" and e.step == kv.step for e in kv.events)
            else:
                assert i == 0, "only the request the admission stopped at waits for blocks"
                need = int(re.search(r"needs (\d+) KV blocks", detail).group(1))
                assert need == math.ceil(min(req.num_tokens, budget - spent) / BLOCK) > free
        elif code == "behind":
            assert i > 0 and f"request {waiting[0].req_id}" in detail
            assert sched.stories.story(waiting[0].req_id, False).waiting_reason.code == "kv-blocks"
        elif code == "max-num-seqs":
            n = int(re.match(r"(\d+) running", detail).group(1))
            assert n == len(sched.running) == cfg.max_num_seqs
        elif code == "token-budget":
            assert spent == budget and f"{budget} tokens are spent" in detail
            for rid, k in re.findall(r"(\S+) (\d+)(?:,|$| and)", detail.split(": ", 1)[1]):
                assert so.num_scheduled_tokens[rid] == int(k)
        elif code == "batch-queue":
            share = math.ceil((len(sched.running) + len(waiting)) / sched.max_concurrent_batches)
            assert len(so.num_scheduled_tokens) == share and f"({share} of" in detail
        else:
            raise AssertionError(f"{code} cannot happen in a scheduling pass: {detail}")


def run(sched: Scheduler, arrivals: dict[int, list[Request]] | None = None, max_steps: int = 400) -> set:
    """Step until every request is done, recounting each step's reasons; the codes seen."""
    seen: set = set()
    arrivals = arrivals or {}
    for n in range(max_steps):
        for r in arrivals.get(n, []):
            sched.add_request(r)
        if not sched.has_unfinished() and n > max(arrivals, default=0):
            return seen
        so = sched.schedule()
        recount(sched, so, seen)
        finish_step(sched, so)
    raise AssertionError(f"not done in {max_steps} steps")


def test_kv_starved_requests_wait_for_blocks_and_the_rest_behind_them():
    sched = scheduler(num_blocks=8)
    for i in range(5):
        sched.add_request(request(f"r{i}", 40, max_tokens=30, seed=i))
    seen = run(sched)
    assert {"kv-blocks", "behind"} <= seen
    assert sched.num_preemptions > 0
    assert not sched.stories.stalls, "a clean load reports no stall"
    # The preemptions in the stories are those of the KV map's events: step and blocks freed.
    kv_preempts = sorted((e.step, e.request, len(e.blocks)) for e in sched.block_manager.events if e.kind == "preempt")
    told = sorted((e.step, s.request_id, e.blocks) for rid in (f"r{i}" for i in range(5))
                  for s in [sched.stories.story(rid, False)] for e in s.events if e.kind == "preempt")
    assert told == kv_preempts and told


def test_a_full_max_num_seqs_holds_the_rest():
    sched = scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(request(f"r{i}", 20, seed=i))
    assert "max-num-seqs" in run(sched)


def test_a_long_chunked_prompt_spends_the_token_budget():
    sched = scheduler(max_num_batched_tokens=32)
    sched.add_request(request("long", 100, max_tokens=3))
    sched.add_request(request("short", 8, seed=1))
    assert "token-budget" in run(sched)
    story = sched.stories.story("long", False)
    chunks = [(e.kind, e.step, e.tokens) for e in story.events if e.kind in ("admit", "chunk")]
    assert chunks == [("admit", 1, 32), ("chunk", 2, 32), ("chunk", 3, 32), ("chunk", 4, 4)]
    kinds = [e.kind for e in story.events]
    assert kinds[0] == "arrive" and kinds[-1] == "finish" and story.first_token_step == 4
    assert story.state == "finished" and story.finish_reason == "length"
    short = sched.stories.story("short", False)
    wait = next(e for e in short.events if e.kind == "wait")
    assert wait.detail.startswith("token-budget") and (wait.step, wait.last_step, wait.count) == (1, 3, 3)


def test_batches_in_flight_hold_the_rest():
    sched = scheduler(mcb=2)
    for i in range(4):
        sched.add_request(request(f"r{i}", 10, seed=i))
    seen: set = set()
    so = sched.schedule()   # the first batch takes its share: half the requests
    recount(sched, so, seen)
    assert seen == {"batch-queue"}
    so2 = sched.schedule()   # the second takes the rest; a third has no slot
    assert len(so2.num_scheduled_tokens) == 2 and not sched.waiting
    sched.add_request(request("late", 10, seed=9))
    sched.note_batch_queue_full(2)
    reason = sched.stories.story("late", False).waiting_reason
    assert reason.code == "batch-queue" and "(2 of 2)" in reason.detail


def test_paused_engine_prefix_hits_and_abort():
    sched = scheduler(enable_prefix_caching=True)
    sched.add_request(request("a", 48))
    run(sched)
    before = sched.block_manager.prefix_hit_tokens
    sched.add_request(request("b", 48))
    sched.add_request(request("c", 20, seed=3))
    assert sched.stories.story("b", paused=True).waiting_reason.code == "paused"
    sched.schedule()
    assert sched.stories.story("b", False).prefix_hit_tokens == sched.block_manager.prefix_hit_tokens - before == 32
    sched.finish_request("c", RequestStatus.FINISHED_ABORTED)
    c = sched.stories.story("c", False)
    assert c.state == "aborted" and c.events[-1].kind == "abort"
    snap = sched.stories.snapshot(sched.step_count, paused=False)
    assert [(r.request_id, r.state) for r in snap.requests] == [("b", "running"), ("a", "finished"),
                                                                ("c", "aborted")]


def test_sched_thrash_is_named_within_its_preemption_limit(caplog):
    sched = scheduler()
    sched_faults.install(faults.parse("sched-thrash:step=2"), sched)
    for i in range(3):
        sched.add_request(request(f"r{i}", 12, max_tokens=200, seed=i))
    with caplog.at_level(logging.WARNING):
        for _ in range(STALL_PREEMPTIONS + 3):
            so = sched.schedule()
            finish_step(sched, so)
    picked = re.search(r"planted sched-thrash: from step (\d+) the scheduler preempts request ([^\s,]+)", caplog.text)
    stall = next(s for s in sched.stories.stalls if s.kind == "thrash")
    assert stall.request_id == picked.group(2) and stall.steps == STALL_PREEMPTIONS + 1
    assert stall.step - int(picked.group(1)) < STALL_PREEMPTIONS + 1
    assert [s.kind for s in sched.stories.stalls] == ["thrash"]


def test_sched_strand_is_named_within_k_steps_tp1(caplog):
    """Through the engine (--inject), at tp=1: one request arrives each step; the one the fault picks never runs."""
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    k = 8   # --stall-steps
    with caplog.at_level(logging.WARNING), LLM("tiny-llama", inject="sched-strand:step=3", stall_steps=k,
                                               threads_per_worker=1) as llm:
        engine = llm.engine
        for n in range(k + 8):
            engine.add_request({"prompt_token_ids": [5 + n, 6, 7, 8]}, params, f"q{n}")
            engine.step()
            if engine.requests_snapshot().stalls:
                break
        snap = engine.requests_snapshot()
    picked = re.search(r"planted sched-strand: from step (\d+) the scheduler skips request ([^\s,]+)", caplog.text)
    assert picked, caplog.text
    stall = snap.stalls[0]
    assert (stall.kind, stall.request_id, stall.reason) == ("passed-over", picked.group(2), "fits")
    assert stall.step - int(picked.group(1)) + 1 <= k == stall.steps
    story = next(r for r in snap.requests if r.request_id == stall.request_id)
    assert story.state == "waiting" and story.num_output_tokens == 0


def test_a_clean_mixed_load_reports_no_stall():
    """Through the engine at tp=1, ~200 steps: long prompts in chunks, a KV cache that forces preemptions, shared
    prefixes that hit the cache, aborts of waiting and running requests. Every waiting request has a reason after
    every step, the reasons by code sum to the waiting count, and the detector (strict: 2 steps) reports nothing."""
    shared = [(11 * j) % 200 + 20 for j in range(48)]
    with LLM("tiny-llama", num_kv_blocks=20, max_num_batched_tokens=48, max_num_seqs=6, stall_steps=2,
             threads_per_worker=1) as llm:
        engine = llm.engine
        aborted, n = [], 0
        for step in range(400):
            if step < 150 and step % 3 == 0:
                prompt = (shared if n % 3 == 0 else []) + [(5 * n + 7 * j) % 230 + 9 for j in range(8 + n * 13 % 90)]
                engine.add_request({"prompt_token_ids": prompt},
                                   SamplingParams(max_tokens=4 + n * 7 % 30, temperature=0, ignore_eos=True), f"m{n}")
                n += 1
            if step % 17 == 5:   # in turn the newest (likely waiting) and the oldest live (likely running) request
                live = engine.unfinished_request_ids()
                if live:
                    rid = live[-1] if step % 2 else live[0]
                    engine.abort_request(rid)
                    aborted.append(rid)
            if not engine.has_unfinished_requests() and step >= 150:
                break
            engine.step()
            sched = engine.core.scheduler
            stats = engine.stats()
            assert sum(stats["num_waiting_by_reason"].values()) == stats["num_waiting"]
            for req in sched.waiting:   # each told why, once a pass has seen it
                assert sched.stories.story(req.req_id, False).waiting_reason is not None, req.req_id
        snap = engine.requests_snapshot()
        stats = engine.stats()
    assert not snap.stalls, snap.stalls
    assert stats["step"] >= 200 and stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    kinds = {e.kind for r in snap.requests for s in [engine.request_story(r.request_id)] if s for e in s.events}
    assert {"chunk", "preempt", "abort", "finish", "wait"} <= kinds, kinds
    assert len(aborted) >= 5 and {r.state for r in snap.requests} >= {"aborted", "finished"}


def test_stories_off_schedule_the_same_and_keep_nothing():
    """SchedulerConfig.request_stories=False (what `bench throughput --stories` compares against): the same steps
    as with stories on, nothing kept, every waiting request counted under no reason."""
    def steps(**cfg):
        sched = scheduler(num_blocks=8, **cfg)
        for i in range(5):
            sched.add_request(request(f"r{i}", 40, max_tokens=30, seed=i))
        out = []
        while sched.has_unfinished():
            so = sched.schedule()
            out.append(dict(so.num_scheduled_tokens))
            by_reason = sched.stats()["num_waiting_by_reason"]
            assert sum(by_reason.values()) == len(sched.waiting)
            if not cfg.get("request_stories", True):
                assert by_reason["none"] == len(sched.waiting)
            finish_step(sched, so)
            assert len(out) < 400
        return sched, out

    on, on_steps = steps()
    off, off_steps = steps(request_stories=False)
    assert off_steps == on_steps and off.num_preemptions == on.num_preemptions > 0
    assert off.stories.snapshot(off.step_count, False).requests == [] and off.stories.story("r0", False) is None
    assert on.stories.story("r0", False) is not None
