"""Each request's story as the scheduler tells it (GET /debug/requests, `devharness requests`): its arrival, the steps
it was passed over and why, its prefill chunks, preemptions, prefix-cache hit, first token and end; and the stall
detector, which names a request that does not get on.

The scheduler calls the StoryBook where a request changes state. A waiting request that stays passed over for the
same reason costs an attribute update a step, not an event: consecutive steps with one reason code are one `wait`
event, and each story keeps its last STORY_EVENTS events.

Each story also keeps when its request was first admitted, gave its first token and ended, and its spells in the
queue (arrival to admission, each preemption to the next admission): what engine/tracing.py sends as spans, through
the `on_end` hook, when a request ends. With `SchedulerConfig.request_stories` off the scheduler tells NoStories
instead, which keeps nothing (a request's queue time is then its first wait only).

Stalls (each reported once, as a Stall and a log warning, and handed once to `take_stalls`: the engine's runner writes
a bundle for them):
    passed-over  a waiting request that no reason holds (it fits) is passed over `stall_steps` steps in a row
    idle-queue   requests wait and nothing runs for `stall_idle_s` seconds while the engine is not paused
    thrash       a request is preempted more than `stall_preemptions` times
"""
from __future__ import annotations

import logging
import time
from collections import deque

from devharness.config import STALL_IDLE_S, STALL_PREEMPTIONS, STALL_STEPS
from devharness.engine.request import Request, RequestStatus
from devharness.protocol.messages import RequestStory, RequestsSnapshot, Stall, StoryEvent, WaitingReason

logger = logging.getLogger(__name__)

KV_BLOCKS, MAX_NUM_SEQS, TOKEN_BUDGET, BATCH_QUEUE, PAUSED, BEHIND = (
    "kv-blocks", "max-num-seqs", "token-budget", "batch-queue", "paused", "behind")
REASON_CODES = (KV_BLOCKS, MAX_NUM_SEQS, TOKEN_BUDGET, BATCH_QUEUE, PAUSED, BEHIND)
# A waiting request with no reason: it arrived after the last scheduling pass, or the pass skipped it although it fits.
NO_REASON = "none"
UNEXPLAINED = "passed over although no reason held it (it fits)"
PAUSED_REASON = (PAUSED, "the engine is paused (POST /debug/engine/resume lets it go on)")

STORY_EVENTS = 48        # events kept per request (its arrival aside)
FINISHED_KEPT = 64       # finished or aborted requests whose story is kept
STALLS_KEPT = 100
SPELLS_KEPT = 16         # queue spells kept per request (a thrashing one has many)


def describe(stall: Stall) -> str:
    return f"request {stall.request_id} {stall.kind}: {stall.detail} (step {stall.step})"


class _Event:
    __slots__ = ("kind", "step", "detail", "last_step", "count", "tokens", "blocks", "time", "code")

    def __init__(self, kind: str, step: int, detail: str = "", tokens: int | None = None, blocks: int | None = None,
                 code: str | None = None):
        self.kind, self.step, self.detail, self.tokens, self.blocks = kind, step, detail, tokens, blocks
        self.last_step, self.count, self.time, self.code = None, 1, time.time(), code

    def wire(self) -> StoryEvent:
        return StoryEvent(self.kind, self.step, self.detail, self.last_step, self.count, self.tokens, self.blocks,
                          self.time)


class Story:
    __slots__ = ("req", "arrival", "events", "reason", "unexplained", "queued_total", "queued_since",
                 "first_token_step", "prefix_hit_tokens", "thrash_reported", "admitted_at", "first_token_at",
                 "ended_at", "spells")

    def __init__(self, req: Request, step: int):
        self.req = req
        self.arrival = _Event("arrive", step, f"{req.num_prompt_tokens} prompt tokens")
        self.arrival.time = req.arrival_time   # the request's own: its span starts there (engine/tracing.py)
        self.events: deque[_Event] = deque(maxlen=STORY_EVENTS)
        self.reason: tuple[str, str] | None = None   # (code, detail) of the last step that passed it over
        self.unexplained = 0                         # steps in a row it was passed over with no reason
        self.queued_total = 0.0
        self.queued_since: float | None = req.arrival_time
        self.first_token_step: int | None = None
        self.prefix_hit_tokens = 0
        self.thrash_reported = False
        # Wall-clock times (time.time(), as the events'): first admission, first token, end; the queue spells.
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self.spells: list[tuple[float, float]] = []

    def _dequeue(self, now: float) -> None:
        """Its wait in the queue, if it waits, ends now."""
        since = self.queued_since
        if since is not None:
            self.queued_total += now - since
            self.queued_since = None
            if len(self.spells) < SPELLS_KEPT:
                self.spells.append((since, now))

    def state(self) -> str:
        s = self.req.status
        if s.finished:
            return "aborted" if s == RequestStatus.FINISHED_ABORTED else "finished"
        return s.value

    def wire(self, paused: bool, events: bool) -> RequestStory:
        req, now = self.req, time.time()
        waiting = req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        reason = (PAUSED_REASON if paused else self.reason) if waiting else None
        queued = self.queued_total + (now - self.queued_since if self.queued_since is not None else 0.0)
        return RequestStory(
            request_id=req.req_id, state=self.state(), waiting_reason=WaitingReason(*reason) if reason else None,
            arrival_time=req.arrival_time, queued_s=round(queued, 6), num_preemptions=req.num_preemptions,
            prefix_hit_tokens=self.prefix_hit_tokens, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids), first_token_step=self.first_token_step,
            finish_reason=req.finish_reason,
            events=[self.arrival.wire(), *(e.wire() for e in self.events)] if events else [])


class StoryBook:
    """The stories of the live requests and of the last FINISHED_KEPT finished ones, and the stalls seen."""

    def __init__(self, stall_steps: int = STALL_STEPS, stall_idle_s: float = STALL_IDLE_S,
                 stall_preemptions: int = STALL_PREEMPTIONS):
        self.stall_steps, self.stall_idle_s, self.stall_preemptions = stall_steps, stall_idle_s, stall_preemptions
        self.live: dict[str, Story] = {}
        self.finished: deque[Story] = deque(maxlen=FINISHED_KEPT)
        self.stalls: deque[Stall] = deque(maxlen=STALLS_KEPT)
        self._idle_since: float | None = None
        self._idle_reported = False
        self._idle_stall: Stall | None = None   # the idle-queue stall of the idle spell now, once reported
        self._fresh: list[Stall] = []            # reported since the last take_stalls
        self.on_end = None                       # called with each Story whose request ended (engine/tracing.py)

    # -- what the scheduler tells it --------------------------------------------------------

    def arrive(self, req: Request, step: int) -> None:
        self.live[req.req_id] = Story(req, step)

    def admit(self, req: Request, step: int, tokens: int, hit_tokens: int) -> None:
        st = self.live.get(req.req_id)
        if st is None:
            return
        ev = _Event("admit", step, f"{hit_tokens} prompt tokens from the prefix cache", tokens=tokens)
        st._dequeue(ev.time)
        if st.admitted_at is None:
            st.admitted_at = ev.time
        st.reason, st.unexplained = None, 0
        req.queued_s = st.queued_total
        st.prefix_hit_tokens = max(st.prefix_hit_tokens, hit_tokens)
        st.events.append(ev)

    def chunk(self, req: Request, step: int, tokens: int) -> None:
        """A prefill chunk of a request already running (its first chunk is its admit event)."""
        st = self.live.get(req.req_id)
        if st is not None:
            st.events.append(_Event("chunk", step, tokens=tokens))

    def preempt(self, req: Request, step: int, why: str, blocks: int) -> None:
        st = self.live.get(req.req_id)
        if st is None:
            return
        ev = _Event("preempt", step, why, blocks=blocks)
        st.queued_since = ev.time
        st.events.append(ev)
        if req.num_preemptions > self.stall_preemptions and not st.thrash_reported:
            st.thrash_reported = True
            self._stall(req.req_id, "thrash", req.num_preemptions, why,
                        f"preempted {req.num_preemptions} times (more than {self.stall_preemptions}); "
                        f"the last at step {step}", step)

    def first_token(self, req: Request, step: int) -> None:
        st = self.live.get(req.req_id)
        if st is not None:
            ev = _Event("first-token", step)
            st.first_token_step, st.first_token_at = step, ev.time
            st.events.append(ev)

    def finish(self, req: Request, step: int) -> None:
        st = self.live.pop(req.req_id, None)
        if st is None:
            return
        aborted = req.status == RequestStatus.FINISHED_ABORTED
        ev = _Event("abort" if aborted else "finish", step, "" if aborted else req.finish_reason or "")
        st._dequeue(ev.time)
        st.ended_at = ev.time
        req.queued_s = st.queued_total
        st.events.append(ev)
        self.finished.append(st)
        if self.on_end is not None:
            try:
                self.on_end(st)
            except Exception:   # a tracer that fails must not fail the step
                logger.exception("the request-end hook failed for request %s", req.req_id)

    def passed_over(self, step: int, stepped: bool, waiting, reason: tuple[str, str] | None, blocked: Request | None,
                    shared: bool, num_running: int) -> None:
        """After a scheduling pass: every request still waiting was passed over. `reason` holds `blocked` (the request
        the admission stopped at) and, when `shared`, every request behind it too; the others behind it wait
        behind it. A request before `blocked` (or any, when nothing stopped the admission) had no reason to wait.
        `stepped`: the pass made step `step` (a pass that scheduled nothing records no event)."""
        explained = False
        behind = (BEHIND, f"behind request {blocked.req_id} (first come, first served)") if blocked else None
        live = self.live
        for req in waiting:
            st = live.get(req.req_id)
            if st is None:
                continue
            if req is blocked:
                r, explained = reason, True
            elif explained:
                r = reason if shared else behind
            else:
                r = None
            st.reason = r
            if not stepped:
                continue
            code, detail = r if r is not None else ("", UNEXPLAINED)
            last = st.events[-1] if st.events else None
            if last is not None and last.kind == "wait" and last.code == code:
                last.last_step, last.count = step, last.count + 1
                last.detail = f"{code}: {detail}" if code else detail
            else:
                st.events.append(_Event("wait", step, f"{code}: {detail}" if code else detail, code=code))
            if r is None:
                st.unexplained += 1
                if st.unexplained == self.stall_steps:
                    self._stall(req.req_id, "passed-over", st.unexplained, "fits",
                                f"passed over {st.unexplained} steps in a row (steps {step - st.unexplained + 1}.."
                                f"{step}) although no reason held it", step)
            else:
                st.unexplained = 0
        self._check_idle(step, bool(waiting) and num_running == 0)

    def _check_idle(self, step: int, idle: bool) -> None:
        if not idle:
            self._idle_since, self._idle_reported, self._idle_stall = None, False, None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif not self._idle_reported and now - self._idle_since >= self.stall_idle_s:
            self._idle_reported = True
            head = next(iter(self.live.values()), None)
            waiting = [s for s in self.live.values() if s.req.status != RequestStatus.RUNNING]
            head = waiting[0] if waiting else head
            self._stall(head.req.req_id if head else None, "idle-queue", step, head.reason[0] if head and head.reason
                        else "fits", f"{len(waiting)} request(s) waited {now - self._idle_since:.1f} s with nothing "
                        f"running and the engine not paused", step)
            self._idle_stall = self.stalls[-1]

    def _stall(self, rid: str | None, kind: str, steps: int, reason: str, detail: str, step: int) -> None:
        stall = Stall(rid, kind, steps, reason, detail, step, time.time())
        self.stalls.append(stall)
        if len(self._fresh) < STALLS_KEPT:
            self._fresh.append(stall)
        logger.warning("stall: %s", describe(stall))

    # -- what the tools read ------------------------------------------------------------------

    def take_stalls(self) -> list[Stall]:
        """The stalls reported since the last call (each is handed out once)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def active_stalls(self) -> list[str]:
        """The stalls that still hold, described (EngineStats.stalls: the TUI's hang view shows them): their request
        is live, or, for idle-queue, nothing has run since."""
        return [describe(s) for s in self.stalls
                if s is self._idle_stall or (s.kind != "idle-queue" and s.request_id in self.live)]

    def waiting_by_reason(self, waiting) -> dict[str, int]:
        """How many of `waiting` each reason code holds (NO_REASON: none holds it); the counts sum to len(waiting)."""
        counts = dict.fromkeys((*REASON_CODES, NO_REASON), 0)
        for req in waiting:
            st = self.live.get(req.req_id)
            counts[st.reason[0] if st is not None and st.reason else NO_REASON] += 1
        return counts

    def snapshot(self, step: int, paused: bool) -> RequestsSnapshot:
        live = sorted(self.live.values(), key=lambda s: s.req.arrival_time)
        return RequestsSnapshot(step, paused, [s.wire(paused, False) for s in (*live, *self.finished)],
                                list(self.stalls), time.time())

    def story(self, request_id: str, paused: bool) -> RequestStory | None:
        st = self.live.get(request_id) or next((s for s in reversed(self.finished) if s.req.req_id == request_id),
                                               None)
        return st.wire(paused, True) if st is not None else None


class NoStories:
    """What the scheduler tells when `SchedulerConfig.request_stories` is off: nothing is kept, no stall is looked for,
    every waiting request's reason is NO_REASON. A request's queue time (RequestOutput.queued_s) is its first wait."""

    on_end = None
    stalls: tuple = ()

    def arrive(self, req, step):
        pass

    def admit(self, req, step, tokens, hit_tokens):
        if req.num_preemptions == 0:
            req.queued_s = time.time() - req.arrival_time

    def chunk(self, req, step, tokens):
        pass

    def preempt(self, req, step, why, blocks):
        pass

    def first_token(self, req, step):
        pass

    def finish(self, req, step):
        pass

    def passed_over(self, step, stepped, waiting, reason, blocked, shared, num_running):
        pass

    def take_stalls(self) -> list:
        return []

    def active_stalls(self) -> list:
        return []

    def waiting_by_reason(self, waiting) -> dict[str, int]:
        counts = dict.fromkeys((*REASON_CODES, NO_REASON), 0)
        counts[NO_REASON] = len(waiting)
        return counts

    def snapshot(self, step: int, paused: bool) -> RequestsSnapshot:
        return RequestsSnapshot(step, paused, [], [], time.time())

    def story(self, request_id: str, paused: bool):
        return None
