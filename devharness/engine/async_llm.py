"""AsyncLLM: an asyncio front for LLMEngine. One thread owns the engine and steps it; callers
stream RequestOutputs through per-request asyncio queues.

The engine is not thread-safe, so every engine call (add, abort, step, shutdown) happens on the
engine thread. Callers hand it commands under `_cv`; it hands outputs back with
`loop.call_soon_threadsafe`. Pausing holds the thread between steps: commands (adds, aborts)
are still applied, so a paused engine queues requests and loses none.

The engine's life is its supervisor's (engine/supervisor.py: the state, serving, paused, restarting, dead,
stopping; health checks, bundles, the hang detector, restarts, shutdown): this is the bridge between asyncio and
the thread that steps the engine. A dead worker is found by a failed step, by a health check, or by the engine
thread itself, which asks the supervisor to look every LIVENESS_CHECK_S while it has nothing to do. The engine
thread then ends every request with the supervisor's answer (EngineDeadError) and, when it says so, has it restart
the workers and serves again; meanwhile new requests and pauses raise EngineRestartingError. Otherwise the engine
stays dead.

With batches in flight, a pause first waits for those batches to come back (nothing runs on the
workers while paused), and a paused engine steps one batch at a time: each `step_once` step sends
one batch and applies its output.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from devharness.engine.args import EngineArgs
from devharness.engine.llm_engine import LLMEngine
from devharness.engine.output import RequestOutput
from devharness.engine.request_stream import RequestStream, StepWaiter, deliver
from devharness.engine.supervisor import EngineSupervisor, Outcome, State
from devharness.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A debugger may hold a worker inside a step for hours, so a health ping that outlasts this only
# means "busy"; a dead worker is reported by the ping raising or by a failed step.
HEALTH_PING_TIMEOUT_S = 5.0
# On shutdown, how long a running step gets to finish before its workers are stopped under it.
SHUTDOWN_STEP_WAIT_S = 2.0
ENGINE_SHUTDOWN_S = 30.0
# While idle, the engine thread asks the executor this often whether every worker is alive (a look at
# process sentinels or Ray's liveness refs, not a call the workers must answer).
LIVENESS_CHECK_S = 1.0
# How long `inspect` waits for the engine thread to come between steps before it reads the engine itself.
INSPECT_WAIT_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine loop is gone (a worker failed, or shutdown); in-flight requests end with this."""


class EngineRestartingError(EngineDeadError):
    """The workers are being restarted after a failure; try again in `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class _Add:
    stream: RequestStream
    text: str | None
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    stream: RequestStream


@dataclass(frozen=True)
class _Ping:
    waiter: StepWaiter


@dataclass(frozen=True)
class _Inspect:
    fn: Callable[[LLMEngine], object]
    waiter: StepWaiter


_Command = _Add | _Abort | _Ping | _Inspect   # what callers hand the engine thread


class RequestFailedError(RuntimeError):
    """One request failed on its own (a worker could not prepare or sample its rows); the engine goes on."""


class AsyncLLM:
    """Owns an LLMEngine and its step thread; `generate()` streams, `pause/resume/step_once` hold it."""

    def __init__(self, engine: LLMEngine, supervisor: EngineSupervisor | None = None):
        """Step `engine` on a thread of its own; `supervisor`: the one that owns the engine's life (one is made
        for it if not given)."""
        self.engine, self.model_name = engine, engine.config.model.model
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        # Serving, paused, restarting, dead, stopping: the supervisor's state, and its decisions after a failure.
        self.supervisor = supervisor if supervisor is not None else EngineSupervisor(engine)
        self._sup = self.supervisor.machine
        self._cv = threading.Condition(self.supervisor.lock)   # the supervisor's state and our requests change together
        # Everything below is guarded by _cv.
        self._commands: list[_Command] = []
        self._streams: dict[str, RequestStream] = {}
        self._waiters: list[StepWaiter] = []
        self._step_credits = 0
        self._credited_steps = 0      # steps run on step_once credits; step_once targets count these
        self._in_flight = 0           # batches sent to the workers whose output has not come back
        self._stopping = False        # the engine thread is to end (shutdown)
        self._dead: EngineDeadError | None = None   # the supervisor's death, as the error raised (dead_error)
        self._stats: dict = {**engine.stats(), "steps_run": 0}
        self._step_listeners: list[Callable[[float, dict], None]] = []
        # Engine-thread-only: the requests inside the engine.
        self._live: dict[str, RequestStream] = {}
        self._needs_flush = False
        self._busy = False
        self._step_started: float | None = None   # monotonic time the running step began; None between steps
        self._thread = threading.Thread(target=self._run, name="devharness-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        supervisor = EngineSupervisor.start(args.create_engine_config())
        return cls(supervisor.engine, supervisor)

    # -- requests (any thread with a running event loop) --------------------------------------

    def process_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Validate and tokenize a prompt; pure given the tokenizer, so safe off the engine thread."""
        return self.engine.process_prompt(prompt)

    def add_request(self, prompt, params: SamplingParams, request_id: str,
                    processed: tuple[str | None, list[int]] | None = None) -> RequestStream:
        """Check everything the engine would, then queue the request. Raises ValueError for bad input
        and EngineDeadError when the engine is gone, both before any output exists."""
        self.engine.check_params(params)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        text, ids = processed if processed is not None else self.process_prompt(prompt)
        stream = RequestStream(request_id, ids, on_abort=self._abort)
        with self._cv:
            self._raise_if_unavailable()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._commands.append(_Add(stream, text, params))
            self._cv.notify()
        return stream

    @property
    def num_requests(self) -> int:
        """Requests added and not finished or aborted yet, queued and running alike."""
        return len(self._streams)

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Each step's output until the request finishes; closing or cancelling the iterator aborts it."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def _abort(self, stream: RequestStream) -> None:
        # By identity: once this request ended, its id may belong to a newer one.
        with self._cv:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
            self._commands.append(_Abort(stream))
            self._cv.notify()

    def _raise_if_unavailable(self) -> None:
        why = self._sup.refusal()
        if why is None:
            return
        if self._sup.state is State.RESTARTING:
            raise EngineRestartingError(why, self.retry_after_s())
        raise EngineDeadError(why)

    # -- debug hooks --------------------------------------------------------------------------

    async def pause(self) -> dict:
        """Hold the engine between steps; returns once no step is running (none in flight). Requests keep
        queueing."""
        return await self._hold(0)

    async def resume(self) -> dict:
        with self._cv:
            self._raise_if_unavailable()
            self._sup.resume()
            self._step_credits = 0
            self._cv.notify()
        return self.stats()

    async def step_once(self, n: int = 1) -> dict:
        """Pause (if running) and run exactly `n` engine steps, idle steps included; stays paused. Each step
        runs one batch to its end (after the batches in flight when it paused came back)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"step_once: n={n!r} must be an integer >= 1")
        return await self._hold(n)

    async def _hold(self, num_steps: int) -> dict:
        waiter = StepWaiter()
        with self._cv:
            self._raise_if_unavailable()
            self._sup.pause()
            if num_steps:
                self._step_credits += num_steps
                waiter.target = self._credited_steps + self._step_credits
            self._waiters.append(waiter)
            self._cv.notify()
        await waiter.future
        return self.stats()

    @property
    def paused(self) -> bool:
        return self._sup.state is State.PAUSED

    def add_step_listener(self, fn: Callable[[float, dict], None]) -> None:
        """`fn(step_seconds, stats)` after every step, on the engine thread: keep it short."""
        self._step_listeners.append(fn)

    # -- health and stats ---------------------------------------------------------------------

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine died (the supervisor's word), as the error its requests end with; None while it lives
        (and after a shutdown that no death came before)."""
        error = self._sup.error
        if error is not None and self._dead is None:
            self._dead = EngineDeadError(error)
        return self._dead

    @property
    def restarting(self) -> bool:
        return self._sup.state is State.RESTARTING

    @property
    def supervisor_state(self) -> State:
        return self._sup.state

    def restarting_message(self) -> str:
        return self._sup.restarting_message()

    def retry_after_s(self) -> int:
        """While restarting: whole seconds until the restart should be done, judged by how long the workers
        took to start last time; at least 1."""
        return self._sup.retry_after_s(time.monotonic(), self.engine.core.workers_start_s)

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine or a worker is dead (a ping through the engine thread)."""
        waiter = StepWaiter()
        with self._cv:
            self._raise_if_unavailable()
            self._commands.append(_Ping(waiter))
            self._cv.notify()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), HEALTH_PING_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        self._raise_if_unavailable()

    async def inspect(self, fn: Callable[[LLMEngine], object], timeout_s: float = INSPECT_WAIT_S):
        """`fn(engine)`'s result, read on the engine thread between steps (a paused engine too), so that what it
        reads is one step's end. When the engine thread does not come within `timeout_s` (a step held up by a rank
        paused or hung, a restart, a stopped loop), `fn` runs here: that thread is then waiting on the workers and
        changes nothing that the driver keeps."""
        waiter = StepWaiter()
        with self._cv:
            self._commands.append(_Inspect(fn, waiter))
            self._cv.notify()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except asyncio.TimeoutError:
            return fn(self.engine)

    def step_running_s(self) -> float | None:
        """How long the step running now has run (None between steps): a rank paused or hung holds it."""
        started = self._step_started
        return None if started is None else time.monotonic() - started

    def stats(self) -> dict:
        """The engine's stats as of its last step or command, plus the loop's own state."""
        with self._cv:
            restarts = self._sup.restarts
            return {**self._stats, **self.supervisor.live_stats(), "state": self._sup.state_name, "paused": self.paused,
                    "num_requests": len(self._streams), "restarts": len(restarts),
                    "last_restart": restarts[-1] if restarts else None}

    # -- shutdown -----------------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Refuse new requests and end every in-flight one with EngineDeadError(reason): the supervisor stops
        (no restart after this)."""
        with self._cv:
            self._sup.stop(reason)
            streams, self._streams = list(self._streams.values()), {}
            self._commands.extend(_Abort(s) for s in streams)
            self._step_credits = 0
            self._cv.notify()
        err = EngineDeadError(reason)
        for s in streams:
            s._push(err)

    def shutdown(self, timeout_s: float = SHUTDOWN_STEP_WAIT_S) -> None:
        """Stop the loop and the engine's workers; safe to call twice. A step still running after
        `timeout_s` (a rank paused in a debugger, or hung) is not waited for: the workers are stopped."""
        self.close("the engine was shut down")
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive() and self._step_started is not None:
            # The engine thread waits for that step; its workers must not outlive the server, so they
            # are stopped from here, and the step then fails and lets the thread end.
            logger.warning("step %d still running after %.0f s (a rank paused or hung): stopping the workers "
                           "without waiting for it", self._stats.get("step", 0) + 1, timeout_s)
            self.supervisor.shutdown(force=True)
        self._thread.join(ENGINE_SHUTDOWN_S)   # the thread shuts the engine down on its way out
        if self._thread.is_alive():
            logger.error("the engine thread did not stop; shutting the workers down anyway")
            self.supervisor.shutdown(force=True)

    # -- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                look = False
                with self._cv:
                    while True:
                        self._settle_waiters_locked()
                        usable, paused = self._sup.workers_usable, self.paused
                        restarting = self._sup.state is State.RESTARTING
                        if self._stopping or self._commands or self._step_credits or restarting or (
                                usable and (self._busy and not paused or paused and self._in_flight)):
                            break
                        if not self._cv.wait(LIVENESS_CHECK_S) and self._sup.checks_health:
                            look = True
                            break
                    if self._stopping:
                        return
                    if not restarting:   # else they wait: what a command needs comes back with the workers
                        commands, self._commands = self._commands, []
                if restarting:
                    self._restart_workers()
                    continue
                if look:
                    self._check_workers()
                for cmd in commands:
                    self._apply(cmd)
                # Failed workers that are not being replaced (dead, or stopping) run no more steps.
                self._busy = self._sup.workers_usable and (self._needs_flush or self.engine.has_unfinished_requests())
                with self._cv:
                    if not self._sup.workers_usable:
                        self._step_credits = 0
                        continue
                    paused = self.paused
                    drain = paused and self._in_flight > 0   # a pause waits for the batches in flight
                    credited = paused and not drain and self._step_credits > 0
                    run = drain or credited or (self._busy and not paused)
                    if credited:
                        self._step_credits -= 1
                    if not run:
                        self._stats = {**self.engine.stats(), "steps_run": self._stats["steps_run"]}
                        continue
                    max_in_flight = 1 if paused else None
                self._step(credited, max_in_flight)
        except BaseException as e:   # a bug in this loop must not leave callers waiting forever
            logger.exception("engine loop crashed")
            with self._cv:
                outcome = self._sup.crashed(f"the engine loop crashed: {type(e).__name__}: {e}")
            self._fail_all(self._error_of(outcome))
        finally:
            self._finish_thread()

    def _apply(self, cmd: _Command) -> None:
        if isinstance(cmd, _Add):
            stream, text, params = cmd.stream, cmd.text, cmd.params
            rid = stream.request_id
            with self._cv:
                if self._streams.get(rid) is not stream:   # aborted before it reached the engine
                    return
            try:
                if (dead := self.dead_error) is not None:
                    raise dead
                self.engine.add_processed(text, stream.prompt_token_ids, params, rid)
            except (ValueError, EngineDeadError) as e:
                self._abort(stream)
                stream._push(e)
                return
            self._live[rid] = stream
        elif isinstance(cmd, _Abort):
            stream = cmd.stream
            rid = stream.request_id
            if self._live.get(rid) is stream:
                del self._live[rid]
                self.engine.abort_request(rid)
                # The workers still hold the request's state: one more step tells them to drop it.
                self._needs_flush = True
        elif isinstance(cmd, _Inspect):
            try:
                cmd.waiter.settle(cmd.fn(self.engine))
            except Exception as e:
                cmd.waiter.settle(error=e)
        else:
            self._check_workers()
            cmd.waiter.settle()

    def _check_workers(self) -> None:
        outcome = self.supervisor.check_health()
        if outcome is not None:
            self._carry_out(outcome)

    def _restart_workers(self) -> None:
        """On the engine thread, after the supervisor chose to restart: every request has failed already."""
        failed = self.supervisor.restart()
        if failed is not None:
            self._fail_all(self._error_of(failed))
            return
        with self._cv:
            self._in_flight, self._needs_flush, self._busy = 0, False, False
            self._stats = {**self.engine.stats(), "steps_run": self._stats["steps_run"]}

    def _step(self, credited: bool, max_in_flight: int | None) -> None:
        t0 = time.perf_counter()
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step(max_in_flight)
        except Exception as e:
            step = self._stats.get("step", 0) + 1
            if not self._stopping:
                logger.exception("engine step %d failed", step)
            self._workers_failed(f"engine step {step} failed: {type(e).__name__}: {e}",
                                 step_error=f"{type(e).__name__}: {e}")
            return
        finally:
            self._step_started = None
        seconds = time.perf_counter() - t0
        self._needs_flush = False
        stats = self.engine.stats()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cv:
            self._sup.step_completed()
            self._stats = {**stats, "steps_run": self._stats["steps_run"] + 1}
            self._in_flight = stats.get("batches_in_flight", 0)
            if credited:
                self._credited_steps += 1
            for out in outputs:
                rid = out.request_id
                stream = self._live.pop(rid, None) if out.finished else self._live.get(rid)
                if stream is None or self._streams.get(rid) is not stream:   # aborted meanwhile
                    continue
                if out.finished:
                    del self._streams[rid]
                    if out.outputs[0].finish_reason == "error":
                        out = RequestFailedError(out.outputs[0].error)
                by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:   # that caller's loop is closed: nobody will read these
                for stream, _ in items:
                    stream.abort()
        for fn in self._step_listeners:
            try:
                fn(seconds, stats)
            except Exception:
                logger.exception("step listener %r failed", fn)

    def _settle_waiters_locked(self) -> None:
        keep, dead, paused = [], self.dead_error, self.paused
        for w in self._waiters:
            if dead is not None:
                w.settle(error=dead)
            elif self._stopping or not paused or not self._in_flight and (
                    w.target is None or self._credited_steps >= w.target):
                w.settle()
            else:
                keep.append(w)
        self._waiters = keep

    def _workers_failed(self, cause: str, step_error: str | None = None) -> None:
        """Report a failed step to the supervisor (which writes its bundle) and do what it says. Engine thread."""
        self._carry_out(self.supervisor.workers_failed(cause, step_error))

    def _carry_out(self, outcome: Outcome) -> None:
        """After a failure: fail every request with the outcome's error; a restart, if any, is the loop's next
        turn."""
        if outcome.restart:
            with self._cv:
                self._step_credits = 0   # the new workers start serving, not paused
        self._fail_all(self._error_of(outcome))

    def _error_of(self, outcome: Outcome) -> EngineDeadError:
        """What the requests in flight end with: the engine's death, once it died, else the outcome's own."""
        return (self.dead_error if outcome.state is State.DEAD else None) or EngineDeadError(outcome.error)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._cv:
            streams, self._streams = list(self._streams.values()), {}
            waiters, self._waiters = self._waiters, []
            waiters += [c.waiter for c in self._commands if isinstance(c, _Ping)]
            self._commands = [c for c in self._commands if not isinstance(c, _Ping)]
        self._live.clear()
        for s in streams:
            s._push(error)
        for w in waiters:
            w.settle(error=error)

    def _finish_thread(self) -> None:
        with self._cv:
            self._stopping = True
            self._sup.stop("the engine was shut down")   # the first reason stays, if close() gave one
        self._fail_all(self.dead_error or EngineDeadError(self._sup.stop_reason))
        try:
            self.supervisor.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

