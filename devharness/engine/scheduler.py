"""Scheduler: continuous batching with chunked prefill under a token budget, preemption by recompute.

Each step it first gives running requests their next tokens (a decode token, or the next chunk
of a long prompt), preempting the most recently started request when blocks run out, then admits
waiting requests while the token budget, max_num_seqs and free blocks allow.

Batches in flight (`max_concurrent_batches` > 1, vLLM's batch queue): a request whose step has not
come back yet is in flight; it is not scheduled again, nor preempted, until update_from_output has
that step's output. Each batch takes at most 1/max_concurrent_batches of the unfinished requests:
a greedy first batch would take them all and leave the other stages of the pipeline idle. Each batch
also takes at most 1/max_concurrent_batches of max_num_batched_tokens, so that the batches in flight
together hold what one batch would: the pipeline then fills (and drains) in a batch's time, not in a whole
budget's (at pp=2, 1024 prompt tokens on the first stage, ~0.8 s, while the second waits).

Each request's story (engine/request_story.py) is told as it goes: where the admission of waiting requests stops, the
reason it stopped (a code from request_story.REASON_CODES, with the numbers) is every waiting request's reason.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from devharness.config import SchedulerConfig
from devharness.engine.kv_cache import BlockManager, Lookup
from devharness.engine.request import Request, RequestStatus
from devharness.engine.request_story import BATCH_QUEUE, KV_BLOCKS, MAX_NUM_SEQS, TOKEN_BUDGET, NoStories, StoryBook
from devharness.protocol.messages import CachedRequest, ModelRunnerOutput, NewRequest, SchedulerOutput


@dataclass(frozen=True)
class RequestProgress:
    """Where one request stands: its tokens so far (prompt and output) and how many of them are in the KV cache.
    `num_tokens - num_computed_tokens` is what its next step computes: 1 for a request in decode."""
    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The scheduler between steps, copied (Scheduler.snapshot, LLMEngine.scheduler_snapshot): the steps scheduled
    so far and the running and waiting requests, each in the order the scheduler holds them."""
    step: int
    running: tuple[RequestProgress, ...]
    waiting: tuple[RequestProgress, ...]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def all_decoding(self) -> bool:
        """Nothing waits and every running request's next step is one decode token (no prompt chunk is left)."""
        return not self.waiting and all(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, max_concurrent_batches: int = 1):
        self.config = config
        self.stories = StoryBook(config.stall_steps, config.stall_idle_s, config.stall_preemptions) \
            if config.request_stories else NoStories()
        # Why the last scheduling pass left its waiting requests: (reason, the request it stopped at, whether the
        # reason holds every request behind that one too).
        self._held: tuple[tuple[str, str] | None, Request | None, bool] = (None, None, True)
        self.max_concurrent_batches = max_concurrent_batches
        self.in_flight: set[str] = set()   # requests scheduled in a step whose output has not come back
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._dropped_ids: list[str] = []   # finished or preempted since the last step: workers forget them
        self.step_count = 0
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0   # tokens run through the model (prefix hits excluded)
        self.num_generated_tokens_total = 0
        self.kv_alarms: list[str] = []   # KV checksum mismatches not yet bundled (LLMEngine.take_kv_alarms)

    def add_request(self, req: Request) -> None:
        self.requests[req.req_id] = req
        self.waiting.append(req)
        self.stories.arrive(req, self.step_count)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside a step (abort, stop string); frees its blocks."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._dropped_ids.append(req_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not req.status.finished:
            req.status = status
        self.block_manager.free(req)
        self.stories.finish(req, self.step_count)
        return req

    def fail_request(self, req_id: str, message: str, kind: str | None = None) -> Request | None:
        """End one request with an error of its own (FINISHED_ERROR; `kind`: RequestError.kind); the others are
        untouched."""
        req = self.finish_request(req_id, RequestStatus.FINISHED_ERROR)
        if req is not None:
            req.error, req.error_kind = message, kind
        return req

    def fail_all(self, message: str) -> list[Request]:
        """The workers are gone, and with them every request's state and KV cache: end every request with
        `message` (FINISHED_ERROR) and forget the prefix cache, whose blocks no longer hold what they say.
        Step numbers and totals go on."""
        failed = [req for rid in list(self.requests) if (req := self.fail_request(rid, message)) is not None]
        self.in_flight.clear()
        self._dropped_ids = []
        old = self.block_manager
        self.block_manager = new = BlockManager(old.num_blocks, old.block_size, old.enable_prefix_caching)
        new.prefix_hit_tokens, new.prefix_query_tokens = old.prefix_hit_tokens, old.prefix_query_tokens
        new.step, new.events = old.step, old.events   # what happened before: still on the map's log
        return failed

    def _preempt(self, req: Request, why: str) -> None:
        blocks = len(self.block_manager.blocks_of(req.req_id))
        self.block_manager.free(req, kind="preempt")
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_tokens_sent = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._dropped_ids.append(req.req_id)
        self.waiting.appendleft(req)
        self.stories.preempt(req, self.step_count + 1, why, blocks)

    def schedule(self) -> SchedulerOutput:
        """The next step's batch; then every request left waiting is told why (its story)."""
        step = self.step_count
        so = self._schedule()
        reason, blocked, shared = self._held
        self.stories.passed_over(self.step_count, self.step_count != step, self.waiting, reason, blocked, shared,
                                 len(self.running))
        return so

    def note_batch_queue_full(self, num_in_flight: int) -> None:
        """No step is scheduled now: every batch slot of the pipeline is in flight (EngineCore.step)."""
        if self.waiting:
            reason = (BATCH_QUEUE, f"every batch slot is in flight ({num_in_flight} of {self.max_concurrent_batches})")
            self.stories.passed_over(self.step_count, False, self.waiting, reason, self.waiting[0], True,
                                     len(self.running))

    def _kv_need(self, req: Request, hit: list[int], num_hit_tokens: int, n: int) -> int:
        """The free blocks `req` would take to start with `n` tokens after its prefix-cache hit (as allocate_slots
        counts them)."""
        bm = self.block_manager
        return -(-(num_hit_tokens + n) // bm.block_size) - len(hit) + sum(1 for b in hit if bm.ref_counts[b] == 0)

    def _schedule(self) -> SchedulerOutput:
        budget = step_budget = -(-self.config.max_num_batched_tokens // self.max_concurrent_batches)
        bm = self.block_manager
        stories = self.stories
        bm.step = self.step_count + 1
        num_scheduled: dict[str, int] = {}
        cached: list[CachedRequest] = []
        new: list[NewRequest] = []
        preempted_now = False
        in_flight = self.in_flight
        max_reqs = math.ceil((len(self.running) + len(self.waiting)) / self.max_concurrent_batches)

        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < max_reqs:
            req = self.running[i]
            if req.req_id in in_flight:
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_blocks = bm.allocate_slots(req, n)
            while new_blocks is None:
                # The most recent request after this one that is not in flight (its blocks are free to take),
                # else this one.
                victim = self.running.pop(next(j for j in range(len(self.running) - 1, i - 1, -1)
                                               if self.running[j] is req or self.running[j].req_id not in in_flight))
                self._preempt(victim, f"KV blocks ran out for request {req.req_id}")
                preempted_now = True
                if victim is req:
                    break
                new_blocks = bm.allocate_slots(req, n)
            if new_blocks is None:
                break   # it preempted itself: every request after it is in flight
            if req.num_computed_tokens < req.num_prompt_tokens:
                stories.chunk(req, bm.step, n)
            num_scheduled[req.req_id] = n
            budget -= n
            cached.append(CachedRequest(req.req_id, req.all_token_ids[req.num_tokens_sent:], new_blocks,
                                        req.num_computed_tokens, self._generations(new_blocks)))
            req.num_tokens_sent = req.num_tokens
            i += 1

        # Where the admission stops, why: every request left waiting is told (schedule).
        reason, blocked, shared = None, None, True
        while self.waiting:
            req = self.waiting[0]
            if preempted_now:   # the freed blocks go back to the running requests first
                reason = (KV_BLOCKS, f"this step preempted requests for the running ones' KV blocks and admits no "
                                     f"one ({bm.num_free_blocks} free)")
            elif budget <= 0:
                spent = ", ".join(f"{rid} {k}" for rid, k in list(num_scheduled.items())[:4])
                more = f" and {len(num_scheduled) - 4} more" if len(num_scheduled) > 4 else ""
                reason = (TOKEN_BUDGET, f"the step's {step_budget} tokens are spent: {spent}{more}")
            elif len(self.running) >= self.config.max_num_seqs:
                reason = (MAX_NUM_SEQS, f"{len(self.running)} running, max_num_seqs {self.config.max_num_seqs}")
            elif len(num_scheduled) >= max_reqs:
                reason = (BATCH_QUEUE, f"this batch holds its share of the requests ({len(num_scheduled)} of "
                                       f"{len(self.running) + len(self.waiting)}, one batch of "
                                       f"{self.max_concurrent_batches} in flight)")
            elif req.req_id in in_flight:   # an aborted request's id, used again before its last step came back
                reason, shared = (BATCH_QUEUE, "a request of the same id is still in flight"), False
            if reason is not None:
                blocked = req
                break
            found = bm.lookup(req)
            if req.sampling.prompt_logprobs is not None and found.blocks:
                # Prompt logprobs need every prompt position run through the model: no prefix-cache hits.
                found = Lookup([], found.asked, "not read: the request asks for prompt logprobs")
            hit = found.blocks
            num_hit_tokens = len(hit) * bm.block_size
            n = min(req.num_tokens - num_hit_tokens, budget)
            blocks = bm.allocate_slots(req, n, hit)
            if blocks is None:
                reason, blocked, shared = (KV_BLOCKS, f"needs {self._kv_need(req, hit, num_hit_tokens, n)} KV blocks, "
                                                      f"{bm.num_free_blocks} free"), req, False
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit_tokens
            bm.record_lookup(req, found)
            stories.admit(req, bm.step, n, num_hit_tokens)
            self.running.append(req)
            num_scheduled[req.req_id] = n
            budget -= n
            new.append(NewRequest(req.req_id, list(req.all_token_ids), req.num_prompt_tokens, list(blocks),
                                  num_hit_tokens, req.worker_sampling, req.sampling_seed, self._generations(blocks),
                                  eos_token_ids=list(req.eos_token_ids) if req.sampling.min_tokens else []))
            req.num_tokens_sent = req.num_tokens

        self._held = (reason, blocked, shared)
        dropped, self._dropped_ids = self._dropped_ids, []
        if num_scheduled or dropped:   # step numbers count only steps the workers see
            self.step_count += 1
        self.num_computed_tokens_total += sum(num_scheduled.values())
        in_flight.update(num_scheduled)
        if self.config.kv_sanitizer:
            bm.check(self.requests)
        return SchedulerOutput(self.step_count, new, cached, num_scheduled, dropped)

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[tuple]:
        """Advance computed tokens, append sampled ones, finish requests that hit a stop condition.
        Returns (request, new token, logprobs) for each request that sampled, finished ones included, and
        (request, None, None) for each that failed on its own in this step."""
        self.in_flight.difference_update(so.num_scheduled_tokens)
        results, ended = [], False
        for f in out.failed:   # first, so the loops below pass them by
            req = self.fail_request(f.req_id, f.message, f.kind)
            if req is not None:
                results.append((req, None, None))
        if out.kv_alarms:
            results += self._kv_alarms(out.kv_alarms)
        for p in out.prompt_logprobs:
            req = self.requests.get(p.req_id)
            if req is not None and req.prompt_logprobs is not None:
                req.add_prompt_logprobs(p.first, p.logprobs)
        for rid, n in so.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens += n
                self.block_manager.cache_full_blocks(req)
        for i, (rid, tok) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.append_output(tok)
            self.num_generated_tokens_total += 1
            if len(req.output_token_ids) == 1:
                self.stories.first_token(req, so.step)
            if req.check_stop():
                ended = True
                self.running.remove(req)
                self.requests.pop(rid)
                self.block_manager.free(req)
                self._dropped_ids.append(rid)
                self.stories.finish(req, so.step)
            results.append((req, tok, out.logprobs[i] if out.logprobs else None))
        # The manager changed here only where requests ended (the rest: cached prefixes, checked with the tables).
        if self.config.kv_sanitizer and (ended or out.failed or out.kv_alarms):
            self.block_manager.check(self.requests)
        return results

    def _kv_alarms(self, alarms) -> list[tuple]:
        """KV checksum mismatches the ranks found (debug/kv_checksums.py): each block leaves the prefix cache, each
        request that read one ends with every rank's account of it; the others go on. Kept for the runner's bundle."""
        said: dict[str, list[str]] = {}
        for a in alarms:
            self.block_manager.forget_block(a.block, f"KV checksum mismatch on rank {a.rank}")
            for rid in a.readers:
                said.setdefault(rid, []).append(a.message)
        self.kv_alarms += [a.message for a in alarms]
        ended = []
        for rid, messages in said.items():
            req = self.fail_request(rid, "; ".join(messages))
            if req is not None:
                ended.append((req, None, None))
        return ended

    def _generations(self, blocks: list[int]) -> list[int]:
        """With the KV sanitizer, the blocks' generations as handed, for the workers to check before they read."""
        if not self.config.kv_sanitizer:
            return []
        gens = self.block_manager.generation
        return [gens[b] for b in blocks]

    def kv_snapshot(self):
        """The block manager's map (protocol/messages.py KvSnapshot), with the running and waiting requests."""
        reqs = [(r, "running") for r in self.running]
        reqs += [(r, "preempted" if r.status == RequestStatus.PREEMPTED else "waiting") for r in self.waiting]
        return self.block_manager.snapshot(self.step_count, reqs, self.num_preemptions, bool(self.config.kv_sanitizer))

    def snapshot(self) -> SchedulerSnapshot:
        def progress(r: Request) -> RequestProgress:
            return RequestProgress(r.req_id, r.num_tokens, r.num_computed_tokens, r.num_tokens - r.num_prompt_tokens)
        return SchedulerSnapshot(self.step_count, tuple(map(progress, self.running)), tuple(map(progress, self.waiting)))

    def stats(self) -> dict:
        bm = self.block_manager
        return {"step": self.step_count, "num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_blocks_used": bm.num_used_blocks, "kv_blocks_total": bm.num_blocks,
                "prefix_cache_hit_tokens": bm.prefix_hit_tokens, "prefix_cache_query_tokens": bm.prefix_query_tokens,
                "num_preemptions": self.num_preemptions,
                "num_computed_tokens_total": self.num_computed_tokens_total,
                "num_generated_tokens_total": self.num_generated_tokens_total,
                "num_waiting_by_reason": self.stories.waiting_by_reason(self.waiting),
                "stalls": self.stories.active_stalls()}
