"""The scheduler's side of each step, timed for a bench (`bench throughput --stories`, LLMEngine.clock_scheduler):
every call the engine makes into its scheduler, and within them the calls to the requests' stories
(engine/request_story.py). The calls are wrapped on the one scheduler's instance, so an engine nobody clocks pays
nothing. They are timed in the CPU time of the thread that makes them (time.thread_time): the scheduler is pure
Python on the engine's thread, and on a busy machine wall-clock time would also count the moments the thread was
not running (on 2 cores shared with other work: more than the scheduler's own time). The KV sanitizer's check of the
block manager (BlockManager.check, inside schedule and update_from_output) is timed on its own as well."""
from __future__ import annotations

import time

SCHEDULER_CALLS = ("add_request", "schedule", "update_from_output", "finish_request", "note_batch_queue_full")
STORY_CALLS = ("arrive", "admit", "chunk", "preempt", "first_token", "finish", "passed_over")


class _CallClock:
    """Seconds spent in the calls to `names` of `obj` (outermost calls only: finish_request runs inside
    update_from_output for a request that failed)."""

    def __init__(self, obj, names):
        self.seconds, self._depth = 0.0, 0
        for name in names:
            setattr(obj, name, self._timed(getattr(obj, name)))

    def _timed(self, real):
        clock = time.thread_time

        def timed(*args, **kwargs):
            if self._depth:
                return real(*args, **kwargs)
            self._depth = 1
            t0 = clock()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += clock() - t0
                self._depth = 0
        return timed


class SchedulerClock:
    """`scheduler_s`: seconds in the scheduler's calls since the last reset; `stories_s`: in the stories' calls
    within them (0 with request stories off); `kv_check_s`: in the KV sanitizer's checks within them (0 with it off;
    the block manager's as the clock was made: a worker restart makes a new one)."""

    def __init__(self, scheduler):
        self._scheduler = _CallClock(scheduler, SCHEDULER_CALLS)
        self._stories = _CallClock(scheduler.stories, STORY_CALLS)
        self._kv_check = _CallClock(scheduler.block_manager, ("check",))

    @property
    def scheduler_s(self) -> float:
        return self._scheduler.seconds

    @property
    def stories_s(self) -> float:
        return self._stories.seconds

    @property
    def kv_check_s(self) -> float:
        return self._kv_check.seconds

    def reset(self) -> None:
        self._scheduler.seconds = self._stories.seconds = self._kv_check.seconds = 0.0
