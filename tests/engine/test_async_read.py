"""Reading the engine from another thread (AsyncLLM.inspect and read) never runs engine code off the engine loop's
thread: between steps the loop runs the reader's function; while a step is held up (a rank paused in a debugger or
hung) an inspection is withdrawn, so that it never runs, and a read answers from the view the loop published before
that step (with debug on), or raises EngineBusyError."""
import asyncio
import threading

import pytest

from devharness.engine.async_llm import AsyncLLM, EngineBusyError
from devharness.engine.request_stream import RequestStream
from devharness.engine.runner import EngineRunner
from devharness.sampling_params import SamplingParams
from tests.engine.test_engine_loop import SteppingEngine


class HeldEngine(SteppingEngine):
    """Its steps wait for `release` once `hold` is set (a rank paused inside the step); `debug_view` records the
    thread it ran on and the step it describes."""

    def __init__(self, debug: bool, **kw):
        super().__init__(**kw)
        self.config.debug.enabled = debug
        self.hold, self.held, self.release = threading.Event(), threading.Event(), threading.Event()
        self.view_threads: set[str] = set()

    def step(self, max_in_flight=None):
        if self.hold.is_set():
            self.held.set()
            assert self.release.wait(30)
        return super().step(max_in_flight)

    def debug_view(self, paused=False):
        self.view_threads.add(threading.current_thread().name)
        return {"step": self.steps, "paused": paused}


async def held_front(engine: HeldEngine) -> tuple[AsyncLLM, RequestStream]:
    """A front whose engine is inside a held step, with a request in flight."""
    llm = AsyncLLM(engine, EngineRunner(engine, bundles=engine.bundles))
    stream = RequestStream("a", [1], on_abort=llm.loop.abort)
    await llm.inspect(lambda e: None)   # the loop runs
    engine.hold.set()
    llm.loop.add(stream, None, SamplingParams(max_tokens=10**6))
    assert await asyncio.to_thread(engine.held.wait, 30)
    return llm, stream


@pytest.mark.parametrize("debug", [False, True])
def test_a_held_step_gets_no_engine_code_off_its_thread(debug):
    engine = HeldEngine(debug)
    ran: list[str] = []

    async def scenario():
        llm, stream = await held_front(engine)
        try:
            step_before = engine.steps
            with pytest.raises(EngineBusyError, match="did not come between steps within 0.2 s"):
                await llm.inspect(lambda e: ran.append(threading.current_thread().name), timeout_s=0.2)
            if debug:   # the view published before the held step
                got = await llm.read(lambda e: ran.append("read"), lambda view: view, timeout_s=0.2)
                assert got == {"step": step_before, "paused": False}
            else:
                with pytest.raises(EngineBusyError):
                    await llm.read(lambda e: ran.append("read"), lambda view: view, timeout_s=0.2)
            engine.hold.clear()
            engine.release.set()
            # Between steps again: the loop answers, and the withdrawn functions never ran.
            assert await llm.inspect(lambda e: threading.current_thread().name) == "devharness-engine"
            assert await llm.read(lambda e: "fresh", lambda view: "view") == "fresh"
            stream.abort()
        finally:
            llm.shutdown()

    asyncio.run(scenario())
    assert ran == []
    assert engine.view_threads == ({"devharness-engine"} if debug else set())
