"""AsyncLLM: an asyncio front for LLMEngine; callers stream RequestOutputs through per-request asyncio queues.

The engine is owned and stepped by its runner (engine/runner.py's EngineRunner: the state, serving, paused,
restarting, dead, stopping; health checks, bundles, the hang detector, restarts, shutdown), here on a thread of its
own (engine/engine_loop.py: no asyncio in it; it applies commands between steps). This is the bridge between asyncio
and that thread: it checks and tokenizes requests on the caller's thread, hands the loop commands (add, abort, ping,
inspect, pause, resume, step-once), and turns the loop's callbacks into asyncio: each step's outputs reach each
request's queue with `loop.call_soon_threadsafe` (one call per event loop per step), and waiters' results settle
their futures the same way. Nothing here reads the engine: while a step holds the loop, readers get the view the loop
published before that step (`read`).

A request in flight when a worker dies ends with EngineDeadError (the runner's account of the failure, the text
LLM.generate notes on its error too); while the workers restart, new requests and pauses raise
EngineRestartingError; a dead engine refuses everything with EngineDeadError naming the cause.

A pause returns once no batch is in flight (nothing runs on the workers while paused); a paused engine queues
requests and loses none, and `step_once(n)` runs exactly n steps of one batch each.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from devharness.engine.args import EngineArgs
from devharness.engine.engine_loop import (  # noqa: F401 (the errors are this module's API too)
    SHUTDOWN_STEP_WAIT_S, EngineDeadError, EngineRestartingError,
    RequestFailedError)
from devharness.engine.llm_engine import EngineView, LLMEngine
from devharness.engine.output import RequestOutput
from devharness.engine.request_stream import RequestStream, StepWaiter, deliver
from devharness.engine.runner import EngineRunner, State
from devharness.sampling_params import SamplingParams

# A debugger may hold a worker inside a step for hours, so a health ping that outlasts this only
# means "busy"; a dead worker is reported by the ping raising or by a failed step.
HEALTH_PING_TIMEOUT_S = 5.0
# How long `read` waits for the engine loop to come between steps before it answers from the loop's published view.
INSPECT_WAIT_S = 1.0


class EngineBusyError(RuntimeError):
    """The engine loop did not come between steps in time (a step held up); what was asked of it did not run."""


class AsyncLLM:
    """The asyncio front of a supervised LLMEngine and its engine loop; `generate()` streams, `pause/resume/
    step_once` hold it."""

    def __init__(self, engine: LLMEngine, runner: EngineRunner | None = None):
        """Serve `engine`; `runner`: the one that owns the engine and steps it (one is made for it if not given),
        from now on on a thread of its own."""
        self.engine, self.model_name = engine, engine.config.model.model
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        # Serving, paused, restarting, dead, stopping: the runner's state, and its decisions after a failure.
        self.runner = runner if runner is not None else EngineRunner(engine)
        # With debug on (the /debug routes), the loop publishes the engine's view before every step: what those routes
        # answer while a rank sits in a debugger inside the step.
        self.loop = self.runner.start_thread(self._deliver, publish_views=engine.config.debug.enabled)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        runner = EngineRunner.start(args.create_engine_config())
        return cls(runner.engine, runner)

    # -- requests (any thread with a running event loop) --------------------------------------

    def process_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Validate and tokenize a prompt; pure given the tokenizer, so safe off the engine loop."""
        return self.engine.input_processor.process_prompt(prompt)

    def add_request(self, prompt, params: SamplingParams, request_id: str,
                    processed: tuple[str | None, list[int]] | None = None) -> RequestStream:
        """Check everything the engine would, then queue the request. Raises ValueError for bad input
        and EngineDeadError when the engine is gone, both before any output exists."""
        self.engine.input_processor.check_params(params)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        text, ids = processed if processed is not None else self.process_prompt(prompt)
        stream = RequestStream(request_id, ids, on_abort=self.loop.abort)
        self.loop.add(stream, text, params)
        return stream

    @property
    def num_requests(self) -> int:
        """Requests added and not finished or aborted yet, queued and running alike."""
        return self.loop.num_requests

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Each step's output until the request finishes; closing or cancelling the iterator aborts it."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    @staticmethod
    def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """The engine loop's outputs (any thread): one call per event loop, so that a step's outputs arrive
        together."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for item in items:
            by_loop.setdefault(item[0]._loop, []).append(item)
        for loop, mine in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, mine)
            except RuntimeError:   # that caller's loop is closed: nobody will read these
                for stream, _ in mine:
                    stream.abort()

    # -- debug hooks --------------------------------------------------------------------------

    async def pause(self) -> dict:
        """Hold the engine between steps; returns once no step is running (none in flight). Requests keep
        queueing."""
        return await self._hold(0)

    async def resume(self) -> dict:
        self.loop.resume()
        return self.stats()

    async def step_once(self, n: int = 1) -> dict:
        """Pause (if running) and run exactly `n` engine steps, idle steps included; stays paused. Each step
        runs one batch to its end (after the batches in flight when it paused came back)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"step_once: n={n!r} must be an integer >= 1")
        return await self._hold(n)

    async def _hold(self, num_steps: int) -> dict:
        waiter = StepWaiter()
        self.loop.pause(waiter.settle, num_steps)
        await waiter.future
        return self.stats()

    @property
    def paused(self) -> bool:
        return self.runner.state is State.PAUSED

    def add_step_listener(self, fn: Callable[[float, dict], None]) -> None:
        """`fn(step_seconds, stats)` after every step, on the engine loop's thread: keep it short."""
        self.loop.add_step_listener(fn)

    # -- health and stats ---------------------------------------------------------------------

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine died (the runner's word), as the error its requests end with; None while it lives
        (and after a shutdown that no death came before)."""
        return self.loop.dead_error

    @property
    def restarting(self) -> bool:
        return self.runner.state is State.RESTARTING

    @property
    def state(self) -> State:
        """The runner's state (engine/lifecycle.py)."""
        return self.runner.state

    def restarting_message(self) -> str:
        return self.runner.restarting_message()

    def retry_after_s(self) -> int:
        """While restarting: whole seconds until the restart should be done, judged by how long the workers
        took to start last time; at least 1."""
        return self.loop.retry_after_s()

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine or a worker is dead (a ping through the engine loop)."""
        waiter = StepWaiter()
        self.loop.ping(waiter.settle)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), HEALTH_PING_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        self.loop.raise_if_unavailable()

    async def inspect(self, fn: Callable[[LLMEngine], object], timeout_s: float = INSPECT_WAIT_S):
        """`fn(engine)`'s result, run on the engine loop between steps (a paused engine's too), so that what it reads
        or changes is one step's end. EngineBusyError when the loop does not come within `timeout_s` (a step held up
        by a rank paused or hung, a restart, a stopped loop): `fn` then never runs, here or later."""
        waiter = StepWaiter()
        cmd = self.loop.inspect(fn, waiter.settle)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except asyncio.TimeoutError:
            if self.loop.withdraw(cmd):
                raise EngineBusyError(f"the engine did not come between steps within {timeout_s:g} s (a step is "
                                      "held up: a rank paused or hung, or the workers restart)") from None
        # The loop took it up as the wait ended: it runs between steps now.
        return await waiter.future

    async def read(self, fn: Callable[[LLMEngine], object], from_view: Callable[[EngineView], object],
                   timeout_s: float = INSPECT_WAIT_S):
        """`fn(engine)` between steps (inspect); while a step holds the loop past `timeout_s`, `from_view(view)` of
        the view the loop published before that step (with debug on). EngineBusyError when there is none."""
        try:
            return await self.inspect(fn, timeout_s)
        except EngineBusyError:
            view = self.loop.view
            if view is None:
                raise
            return from_view(view)

    def step_running_s(self) -> float | None:
        """How long the step running now has run (None between steps): a rank paused or hung holds it."""
        return self.loop.step_running_s()

    def stats(self) -> dict:
        """The engine's stats as of its last step or command, plus the loop's own state."""
        return self.loop.stats()

    # -- shutdown -----------------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Refuse new requests and end every in-flight one with EngineDeadError(reason): the runner stops
        (no restart after this)."""
        self.loop.close(reason)

    def shutdown(self, timeout_s: float = SHUTDOWN_STEP_WAIT_S) -> None:
        """Stop the loop and the engine's workers (EngineRunner.shutdown); safe to call twice. A step still running
        after `timeout_s` (a rank paused in a debugger, or hung) is not waited for: the workers are stopped."""
        self.loop.stop(timeout_s)
