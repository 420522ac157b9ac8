"""The engine loop (engine/engine_loop.py) on a stand-in engine, no workers and no asyncio: commands are applied in
the order they came, a pause waits for the batches in flight, step-once credits run exactly that many steps, a failed
step fails every request and the workers restart when the supervisor says so (or the engine stays dead), and a stop
ends everything."""
import threading
import time

import pytest

from devharness.engine.engine_loop import EngineDeadError, EngineRestartingError, RequestFailedError
from devharness.engine.output import CompletionOutput, RequestOutput
from devharness.engine.lifecycle import State
from devharness.engine.runner import EngineRunner
from devharness.executor.base import WorkerDied
from devharness.sampling_params import SamplingParams
from tests.engine.test_supervisor import StandInEngine

DEATH = WorkerDied("step 4: rank 1 (tp 1, pp 0, pid 7) died (killed by SIGKILL)", rank=1, cause="killed by SIGKILL")


class SteppingEngine(StandInEngine):
    """A stand-in LLMEngine whose requests each take max_tokens steps, one token a step. With `depth` > 1 it keeps
    that many batches in flight while it has requests (as pp > 1 does): a step leaves min(depth, max_in_flight) - 1
    out. It logs every call the loop makes."""

    def __init__(self, depth=1, **kw):
        super().__init__(**kw)
        self.depth, self.in_flight, self.steps = depth, 0, 0
        self.calls: list[tuple] = []
        self.left: dict[str, int] = {}       # request id -> tokens still to make
        self.fail_next: Exception | None = None
        self.failed_requests: set[str] = set()   # requests that fail alone (finish_reason "error")

    def stats(self):
        return {"step": self.steps, "batches_in_flight": self.in_flight}

    def add_processed(self, text, ids, params, request_id):
        if params.max_tokens > 10_000_000:
            raise ValueError(f"max_tokens={params.max_tokens} is too many")
        self.calls.append(("add", request_id))
        self.left[request_id] = params.max_tokens

    def abort_request(self, request_id):
        self.calls.append(("abort", request_id))
        self.left.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self, max_in_flight=None):
        self.calls.append(("step", max_in_flight))
        time.sleep(0.001)   # the loop runs flat out while busy: leave the cores to the others
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e
        self.steps += 1
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            error = rid in self.failed_requests
            done = error or self.left[rid] == 0
            if done:
                del self.left[rid]
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(
                0, "", [7], finish_reason=("error" if error else "length") if done else None,
                error="rank 0: bad row" if error else None)], finished=done))
        limit = self.depth if max_in_flight is None else min(self.depth, max_in_flight)
        self.in_flight = limit - 1 if self.left else max(0, self.in_flight - 1)
        return outs

    def restart_workers(self, reason):
        super().restart_workers(reason)
        self.left.clear()
        self.in_flight = 0


class Request:
    def __init__(self, request_id):
        self.request_id, self.prompt_token_ids = request_id, [1]


class Caller:
    """What the loop hands back: outputs and errors by request, and waiters' results."""

    def __init__(self):
        self.got: dict[str, list] = {}
        self.lock = threading.Lock()

    def deliver(self, items):
        with self.lock:
            for handle, out in items:
                self.got.setdefault(handle.request_id, []).append(out)

    def of(self, rid):
        with self.lock:
            return list(self.got.get(rid, []))


class Waiter:
    def __init__(self, on_done=None):
        self.event, self.result, self.error, self.on_done = threading.Event(), None, None, on_done

    def __call__(self, result=None, error=None):
        self.result, self.error = result, error
        if self.on_done is not None:
            self.on_done()
        self.event.set()

    def wait(self):
        assert self.event.wait(10), "timed out"
        return self


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def make_loop():
    loops = []

    def make(**kw):
        engine = SteppingEngine(**kw)
        caller = Caller()
        loop = EngineRunner(engine, bundles=engine.bundles).start_thread(caller.deliver)
        loops.append(loop)
        return engine, caller, loop
    yield make
    for loop in loops:
        loop.stop()


def paused(loop, steps=0) -> Waiter:
    waiter = Waiter()
    loop.pause(waiter, steps)
    assert waiter.wait().error is None
    return waiter


def calls(loop) -> list[tuple]:
    """The engine's calls so far, read on the loop's thread after the commands before it."""
    seen = Waiter()
    loop.inspect(lambda e: list(e.calls), seen)
    assert seen.wait().error is None
    return seen.result


def add(loop, rid, max_tokens):
    handle = Request(rid)
    loop.add(handle, None, SamplingParams(max_tokens=max_tokens))
    return handle


def test_commands_are_applied_in_order_and_a_paused_engine_still_takes_them(make_loop):
    engine, caller, loop = make_loop()
    paused(loop)
    a, b = add(loop, "a", 1000), add(loop, "b", 3)
    add(loop, "c", 20_000_000)   # refused by the engine: that request alone ends, with the engine's ValueError
    loop.abort(add(loop, "x", 5))   # aborted before its add reached the engine: the engine never sees it
    add(loop, "y", 5)
    assert calls(loop) == [("add", "a"), ("add", "b"), ("add", "y")]
    loop.abort(a)
    loop.abort(Request("y"))   # not the handle y was added with: a no-op
    add(loop, "z", 5)
    loop.abort(b)
    assert calls(loop)[3:] == [("abort", "a"), ("add", "z"), ("abort", "b")]
    assert "y" in engine.left
    [refused] = caller.of("c")
    assert isinstance(refused, ValueError) and "too many" in str(refused)
    assert loop.num_requests == 2 and loop.stats()["paused"]   # y and z
    time.sleep(0.1)
    assert not any(c[0] == "step" for c in engine.calls)   # paused: nothing ran
    loop.resume()
    wait_for(lambda: caller.of("z") and caller.of("z")[-1].finished)
    assert [o.outputs[0].token_ids for o in caller.of("z")] == [[7]] * 5
    assert caller.of("a") == caller.of("b") == caller.of("x") == []
    wait_for(lambda: loop.num_requests == 0)
    assert loop.stats()["steps_run"] >= 5


def test_a_pause_waits_for_the_batches_in_flight(make_loop):
    engine, caller, loop = make_loop(depth=2)
    add(loop, "a", 10**6)
    wait_for(lambda: engine.steps >= 5)
    at_done = {}
    paused = Waiter(on_done=lambda: at_done.update(in_flight=engine.in_flight, calls=len(engine.calls),
                                                   last=engine.calls[-1]))
    loop.pause(paused)
    assert paused.wait().error is None
    # Running, one batch stayed in flight after every step; the pause returned only after a step of one batch
    # brought it back.
    assert at_done["in_flight"] == 0 and at_done["last"] == ("step", 1)
    assert ("step", None) in engine.calls[:at_done["calls"]]
    time.sleep(0.1)
    assert len(engine.calls) == at_done["calls"]   # and nothing runs while paused
    assert loop.stats()["batches_in_flight"] == 0 and loop.num_requests == 1


@pytest.mark.parametrize("busy", [False, True])
def test_step_once_runs_exactly_n_steps_of_one_batch(make_loop, busy):
    engine, caller, loop = make_loop(depth=2)
    paused(loop)
    if busy:
        add(loop, "a", 10**6)
    before = len(engine.calls)
    paused(loop, steps=3)
    steps = [c for c in engine.calls[before:] if c[0] == "step"]
    assert steps == [("step", 1)] * 3   # idle steps too: each credit is one step
    assert len(caller.of("a")) == (3 if busy else 0)
    time.sleep(0.1)
    assert [c for c in engine.calls[before:] if c[0] == "step"] == steps and loop.stats()["paused"]
    two_more = Waiter()
    loop.pause(two_more, steps=2)
    two_more.wait()
    assert len([c for c in engine.calls[before:] if c[0] == "step"]) == 5


def test_a_failed_step_fails_every_request_and_the_workers_restart(make_loop):
    engine, caller, loop = make_loop()
    add(loop, "a", 10**6), add(loop, "b", 10**6)
    wait_for(lambda: caller.of("a") and caller.of("b"))
    engine.fail_next = DEATH
    assert engine.restarted.wait(10)
    wait_for(lambda: loop.stats()["restarts"] == 1 and loop.stats()["state"] == "running")
    for rid in "ab":
        err = caller.of(rid)[-1]
        assert type(err) is EngineDeadError and "WorkerDied: step 4: rank 1 (tp 1, pp 0" in str(err)
        assert str(err).endswith("(the workers are restarting; send it again shortly)")
    assert [r for r, _ in engine.bundles.written] == ["worker error"]   # the failed step's bundle, once
    assert engine.restart_reasons[0].startswith("the engine failed and its workers are restarting: engine step")
    assert loop.dead_error is None and loop.num_requests == 0
    # The new workers serve; a request that fails alone ends alone.
    engine.failed_requests.add("c")
    add(loop, "c", 5), add(loop, "d", 2)
    wait_for(lambda: caller.of("d") and caller.of("d")[-1].finished)
    wait_for(lambda: caller.of("c"))
    assert isinstance(caller.of("c")[-1], RequestFailedError) and "rank 0: bad row" in str(caller.of("c")[-1])


def test_while_restarting_new_requests_are_refused_with_a_retry_after(make_loop):
    engine, caller, loop = make_loop()
    gate = threading.Event()
    real_restart = engine.restart_workers
    engine.restart_workers = lambda reason: (gate.wait(10), real_restart(reason))
    try:
        engine.fail_next = DEATH
        add(loop, "a", 10**6)
        wait_for(lambda: loop.stats()["state"] == "restarting")
        with pytest.raises(EngineRestartingError, match="restarting after a failure") as info:
            add(loop, "b", 1)
        assert 1 <= info.value.retry_after_s <= 30
        with pytest.raises(EngineRestartingError):
            loop.pause(Waiter())
    finally:
        gate.set()
    wait_for(lambda: loop.stats()["state"] == "running")
    add(loop, "b", 1)
    wait_for(lambda: caller.of("b"))


def test_a_failed_step_without_restarts_is_death(make_loop):
    engine, caller, loop = make_loop(restart_workers=False)
    paused(loop)
    add(loop, "a", 10**6)
    pending = Waiter()
    engine.fail_next = DEATH
    loop.pause(pending, steps=2)   # the first of its steps fails: the waiter fails with the engine
    assert isinstance(pending.wait().error, EngineDeadError)
    err = caller.of("a")[-1]
    assert type(err) is EngineDeadError and err is loop.dead_error and "rank 1 (tp 1, pp 0" in str(err)
    assert engine.restart_reasons == [] and loop.stats()["state"] == "dead"
    with pytest.raises(EngineDeadError, match="rank 1"):
        add(loop, "b", 1)
    steps = len(engine.calls)
    time.sleep(0.1)
    assert len(engine.calls) == steps   # dead workers run no more steps


@pytest.mark.parametrize("by", ["loop", "runner"])
def test_stop_ends_everything(make_loop, by):
    engine, caller, loop = make_loop()
    paused(loop)
    add(loop, "a", 10**6), add(loop, "b", 10**6)
    if by == "loop":
        loop.stop()
    else:   # the runner's shutdown ends its loop first, then stops the engine
        loop.runner.shutdown()
    for rid in "ab":
        [err] = caller.of(rid)
        assert type(err) is EngineDeadError and str(err) == "the engine was shut down"
    assert engine.shut_down == 1 and engine.bundles.closed == 1 and not loop._thread.is_alive()
    assert loop.stats()["state"] == "stopped" and loop.runner.state is State.STOPPED
    with pytest.raises(EngineDeadError, match="shut down"):
        add(loop, "c", 1)
    with pytest.raises(EngineDeadError):
        loop.pause(Waiter())
    loop.stop()   # twice: nothing more
    assert engine.shut_down == 1


def test_close_gives_its_reason_and_the_loop_still_answers(make_loop):
    engine, caller, loop = make_loop()
    add(loop, "a", 10**6)
    wait_for(lambda: caller.of("a"))
    loop.close("the server is shutting down")
    wait_for(lambda: isinstance(caller.of("a")[-1], EngineDeadError))
    assert str(caller.of("a")[-1]) == "the server is shutting down" and loop.num_requests == 0
    with pytest.raises(EngineDeadError, match="the server is shutting down"):
        add(loop, "b", 1)
    seen = Waiter()
    loop.inspect(lambda e: e.left, seen)
    assert seen.wait().result == {}   # its abort reached the engine
    loop.stop()
    assert engine.shut_down == 1 and loop.runner.stop_reason == "the server is shutting down"


def test_a_loop_that_crashes_answers_the_commands_it_had_taken_and_later_ones(make_loop):
    engine, caller, loop = make_loop()

    def crash(e):
        raise SystemExit("a bug in the loop")   # not an Exception: the inspection does not catch it

    first, second = Waiter(), Waiter()
    with loop._cv:   # both are taken in one batch: the second is taken, then never applied
        loop.inspect(crash, first)
        loop.inspect(lambda e: "ran", second)
    assert isinstance(first.wait().error, EngineDeadError) and "SystemExit" in str(first.error)
    assert isinstance(second.wait().error, EngineDeadError), second.result
    late = Waiter()
    loop.inspect(lambda e: "ran", late)   # the loop has ended: nothing would ever run it
    assert isinstance(late.wait().error, EngineDeadError)
