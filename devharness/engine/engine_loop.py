"""EngineLoop: the thread on which an EngineRunner (engine/runner.py) steps a served engine, with no asyncio in it.

The engine is not thread-safe, so every engine call (add, abort, step, shutdown) happens on this loop's thread.
Callers on any thread hand it commands (add, abort, ping, inspect, pause, resume, step-once credits, close, stop)
under `_cv`, a condition variable on the runner's lock, so that the runner's state and the requests change
together; it hands results back through plain callbacks, called on its thread: `deliver(items)` once per step with
every request's output (or the error a request ends with), and each waiter's `done(result=None, error=None)`.
AsyncLLM turns those into asyncio (engine/async_llm.py); the loop knows nothing of event loops. Nobody reads the
engine off this thread: an inspection runs here between steps, and while a step holds the loop (a rank paused in a
debugger or hung) readers get the view the loop published before that step (`view`), or nothing.

The engine's life is its runner's, which starts this loop (EngineRunner.start_thread): the loop steps the engine
through `EngineRunner.step`, which deals with a failed step (bundle, state machine) and raises StepFailed with its
account; the loop then ends every request with that account (EngineDeadError) and, when the state machine chose a
restart, has the runner `recover` on its next turn; meanwhile new requests and pauses raise EngineRestartingError.
A dead worker is also found by a ping, or by the loop itself, which has the runner look every LIVENESS_CHECK_S while
it has nothing to do. The runner's shutdown ends the loop (`end`) and then stops the engine.

Pausing holds the loop between steps: commands (adds, aborts) are still applied, so a paused engine queues requests
and loses none. With batches in flight, a pause first waits for those batches to come back (nothing runs on the
workers while paused), and a paused engine steps one batch at a time: each step-once credit sends one batch and
applies its output.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from devharness.engine.output import RequestOutput
from devharness.engine.lifecycle import Outcome, State, StepFailed
from devharness.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# On shutdown, how long a running step gets to finish before its workers are stopped under it; then how long the
# loop gets to end.
SHUTDOWN_STEP_WAIT_S = 2.0
ENGINE_SHUTDOWN_S = 30.0

# While idle, the loop asks the executor this often whether every worker is alive (a look at process sentinels or
# Ray's liveness refs, not a call the workers must answer).
LIVENESS_CHECK_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine loop is gone (a worker failed, or shutdown); in-flight requests end with this."""


class EngineRestartingError(EngineDeadError):
    """The workers are being restarted after a failure; try again in `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """One request failed on its own (a worker could not prepare or sample its rows, or they held a nan or inf); the
    engine goes on. `kind`: its RequestError.kind (protocol/errors.py's NON_FINITE, or None)."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


# A request, as the loop sees it: any object with `request_id` and `prompt_token_ids` (AsyncLLM's RequestStream).
# The loop hands it back in `deliver`, by identity: once a request ended, its id may belong to a newer one.
Handle = object
Deliver = Callable[[list[tuple[Handle, RequestOutput | BaseException]]], None]
Done = Callable[..., None]   # done(result=None, error=None): called once, on the loop's thread (or by close/stop)


@dataclass(frozen=True)
class _Add:
    handle: Handle
    text: str | None
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    handle: Handle


@dataclass(frozen=True)
class _Ping:
    done: Done


@dataclass(eq=False)   # withdrawn by identity
class _Inspect:
    fn: Callable[[object], object]
    done: Done


_Command = _Add | _Abort | _Ping | _Inspect   # what callers hand the loop


@dataclass
class _Waiter:
    """A caller waiting for a step boundary: any boundary (target None), or `target` credited steps run."""
    done: Done = field(repr=False)
    target: int | None = None


class EngineLoop:
    """Steps a supervised engine on a thread of its own; see the module docstring. Thread-safe."""

    def __init__(self, runner, deliver: Deliver, publish_views: bool = False):
        """`runner`: the EngineRunner that owns the engine and steps it; `deliver(items)`: a step's outputs, as
        (handle, RequestOutput or the error the request ends with) pairs, on the loop's thread. `publish_views`:
        before every step, publish the engine's view (LLMEngine.debug_view) as `view`, what readers get while a step
        holds the loop (a rank paused in a debugger or hung)."""
        self.runner, self.engine, self._deliver = runner, runner.engine, deliver
        self._publish_views = publish_views
        # The engine's view as of the last step boundary before the running step (publish_views), or None: replaced
        # whole on the loop's thread, read whole from any thread.
        self.view = None
        self._cv = threading.Condition(runner.lock)
        # Everything below is guarded by _cv.
        self._commands: list[_Command] = []
        self._requests: dict[str, Handle] = {}   # added and not finished, failed or aborted yet
        self._waiters: list[_Waiter] = []
        self._step_credits = 0
        self._credited_steps = 0      # steps run on step-once credits; waiters' targets count these
        self._in_flight = 0           # batches sent to the workers whose output has not come back
        self._stopping = False        # the loop is to end (stop)
        self._ended = False           # the loop's thread is done: nothing answers a command any more
        self._taken: list[_Command] = []   # commands the loop took and has not applied yet
        self._dead: EngineDeadError | None = None   # the runner's death, as the error raised (dead_error)
        self._stats: dict = {**runner.last_stats, "steps_run": 0}
        self._step_listeners: list[Callable[[float, dict], None]] = []
        # Loop-thread-only: the requests inside the engine.
        self._live: dict[str, Handle] = {}
        self._needs_flush = False
        self._busy = False
        self._step_started: float | None = None   # monotonic time the running step began; None between steps
        self._thread = threading.Thread(target=self._run, name="devharness-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    # -- commands (any thread) ------------------------------------------------------------------

    def add(self, handle: Handle, text: str | None, params: SamplingParams) -> None:
        """Queue a request whose inputs were checked. Raises EngineDeadError (EngineRestartingError while the
        workers restart) when the engine cannot take it, and ValueError when its id is in use."""
        with self._cv:
            self._raise_if_unavailable()
            if handle.request_id in self._requests:
                raise ValueError(f"request id {handle.request_id!r} is already in use")
            self._requests[handle.request_id] = handle
            self._commands.append(_Add(handle, text, params))
            self._cv.notify()

    def abort(self, handle: Handle) -> None:
        """Drop a request (a no-op once it ended)."""
        with self._cv:
            if self._requests.get(handle.request_id) is handle:
                del self._requests[handle.request_id]
            self._commands.append(_Abort(handle))
            self._cv.notify()

    def ping(self, done: Done) -> None:
        """Have the runner look at the workers between steps, then call `done()` (`done(error=...)` if the
        engine died meanwhile). Raises as add does when the engine cannot serve."""
        with self._cv:
            self._raise_if_unavailable()
            self._commands.append(_Ping(done))
            self._cv.notify()

    def inspect(self, fn: Callable[[object], object], done: Done) -> _Inspect:
        """Call `done(fn(engine))` (or `done(error=...)`) between steps, a paused engine's too; the command, for
        `withdraw`."""
        cmd = _Inspect(fn, done)
        with self._cv:
            if not self._ended:
                self._commands.append(cmd)
                self._cv.notify()
                return cmd
        done(error=self.dead_error or EngineDeadError(self.runner.stop_reason))   # no loop to run it
        return cmd

    def withdraw(self, cmd: _Inspect) -> bool:
        """Take back an inspection the loop has not taken up yet: True if it never runs, False if the loop took it
        (it runs, or ran, between steps)."""
        with self._cv:
            if cmd in self._commands:
                self._commands.remove(cmd)
                return True
            return False

    def pause(self, done: Done, steps: int = 0) -> None:
        """Hold the engine between steps, then run `steps` more (step-once credits, one batch each); `done()` once
        none is in flight and those steps ran (`done(error=...)` if the engine died first). Raises as add does."""
        with self._cv:
            self._raise_if_unavailable()
            self.runner.pause()
            waiter = _Waiter(done)
            if steps:
                self._step_credits += steps
                waiter.target = self._credited_steps + self._step_credits
            self._waiters.append(waiter)
            self._cv.notify()

    def resume(self) -> None:
        """Serve again; step-once credits not yet run are dropped. Raises as add does."""
        with self._cv:
            self._raise_if_unavailable()
            self.runner.resume()
            self._step_credits = 0
            self._cv.notify()

    def add_step_listener(self, fn: Callable[[float, dict], None]) -> None:
        """`fn(step_seconds, stats)` after every step, on the loop's thread: keep it short."""
        self._step_listeners.append(fn)

    def close(self, reason: str) -> None:
        """Refuse new requests and end every one in flight with EngineDeadError(reason): the runner stops (no
        restart after this). The loop runs on until stop(): it still answers inspections."""
        with self._cv:
            self.runner.stop(reason)
            handles, self._requests = list(self._requests.values()), {}
            self._commands.extend(_Abort(h) for h in handles)
            self._step_credits = 0
            self._cv.notify()
        if handles:
            err = EngineDeadError(reason)
            self._deliver([(h, err) for h in handles])

    def stop(self, timeout_s: float = SHUTDOWN_STEP_WAIT_S) -> None:
        """Shut the engine down (EngineRunner.shutdown): close, end the loop, stop the workers; safe to call twice.
        A step still running after `timeout_s` (a rank paused in a debugger, or hung) is not waited for: the workers
        are stopped under it, the step fails and the loop ends."""
        self.runner.shutdown(timeout_s=timeout_s)

    def end(self, timeout_s: float) -> bool:
        """Close and end the loop's thread (the runner's shutdown does this first); True if it still runs after
        `timeout_s` (a step held up, or a restart under way)."""
        self.close("the engine was shut down")
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is threading.current_thread():
            return False
        if self._thread.ident is None:   # never started: nothing steps the engine
            self._finish()
            return False
        self._thread.join(timeout_s)
        return self._thread.is_alive()

    # -- what callers read (any thread) ---------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """Requests added and not finished or aborted yet, queued and running alike."""
        return len(self._requests)

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine died (the runner's word), as the error its requests end with; None while it lives
        (and after a shutdown that no death came before)."""
        error = self.runner.error
        if error is not None and self._dead is None:
            self._dead = EngineDeadError(error)
        return self._dead

    def retry_after_s(self) -> int:
        """While restarting: whole seconds until the restart should be done, judged by how long the workers took to
        start last time; at least 1."""
        return self.runner.retry_after_s()

    def step_running_s(self) -> float | None:
        """How long the step running now has run (None between steps): a rank paused or hung holds it."""
        started = self._step_started
        return None if started is None else time.monotonic() - started

    def stats(self) -> dict:
        """The engine's stats as of its last step or command, plus the loop's and the runner's state."""
        with self._cv:
            restarts = self.runner.restarts
            return {**self._stats, **self.runner.live_stats(), "state": self.runner.state_name,
                    "paused": self.runner.state is State.PAUSED, "num_requests": len(self._requests),
                    "restarts": len(restarts), "last_restart": restarts[-1] if restarts else None}

    def raise_if_unavailable(self) -> None:
        """Raise what add would raise now, if anything: EngineRestartingError or EngineDeadError."""
        with self._cv:
            self._raise_if_unavailable()

    def _raise_if_unavailable(self) -> None:
        why = self.runner.refusal()
        if why is None:
            return
        if self.runner.state is State.RESTARTING:
            raise EngineRestartingError(why, self.retry_after_s())
        raise EngineDeadError(why)

    # -- the loop's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                look = False
                with self._cv:
                    while True:
                        self._settle_waiters_locked()
                        usable, paused = self.runner.workers_usable, self.runner.state is State.PAUSED
                        restarting = self.runner.state is State.RESTARTING
                        if self._stopping or self._commands or self._step_credits or restarting or (
                                usable and (self._busy and not paused or paused and self._in_flight)):
                            break
                        if not self._cv.wait(LIVENESS_CHECK_S) and self.runner.checks_health:
                            look = True
                            break
                    if self._stopping:
                        return
                    if not restarting:   # else they wait: what a command needs comes back with the workers
                        self._taken, self._commands = self._commands, []
                if restarting:
                    self._restart_workers()
                    continue
                if look:
                    self._check_workers()
                while self._taken:   # one stays taken until applied: a crash in it answers its caller
                    self._apply(self._taken[0])
                    self._taken.pop(0)
                # Failed workers that are not being replaced (dead, or stopping) run no more steps.
                self._busy = self.runner.workers_usable and (self._needs_flush or self.engine.has_unfinished_requests())
                with self._cv:
                    if not self.runner.workers_usable:
                        self._step_credits = 0
                        continue
                    paused = self.runner.state is State.PAUSED
                    drain = paused and self._in_flight > 0   # a pause waits for the batches in flight
                    credited = paused and not drain and self._step_credits > 0
                    run = drain or credited or (self._busy and not paused)
                    if credited:
                        self._step_credits -= 1
                    if not run:
                        self._stats = {**self.engine.stats(), "steps_run": self._stats["steps_run"]}
                        continue
                    max_in_flight = 1 if paused else None
                if self._publish_views:   # what readers get while this step holds the loop
                    self.view = self.engine.debug_view(paused)
                self._step(credited, max_in_flight)
        except BaseException as e:   # a bug in this loop must not leave callers waiting forever
            logger.exception("engine loop crashed")
            with self._cv:
                outcome = self.runner.crashed(f"the engine loop crashed: {type(e).__name__}: {e}")
                taken, self._taken = self._taken, []   # taken, never to be applied: their callers wait
            error = self._error_of(outcome)
            self._fail_all(error)
            for cmd in taken:
                if isinstance(cmd, (_Ping, _Inspect)):
                    cmd.done(error=error)
            self.runner.shutdown()   # on this thread: the engine stops with its loop
        finally:
            self._finish()

    def _apply(self, cmd: _Command) -> None:
        if isinstance(cmd, _Add):
            handle = cmd.handle
            rid = handle.request_id
            with self._cv:
                if self._requests.get(rid) is not handle:   # aborted before it reached the engine
                    return
            try:
                if (dead := self.dead_error) is not None:
                    raise dead
                self.engine.add_processed(cmd.text, handle.prompt_token_ids, cmd.params, rid)
            except (ValueError, EngineDeadError) as e:
                self.abort(handle)
                self._deliver([(handle, e)])
                return
            self._live[rid] = handle
        elif isinstance(cmd, _Abort):
            handle = cmd.handle
            rid = handle.request_id
            if self._live.get(rid) is handle:
                del self._live[rid]
                self.engine.abort_request(rid)
                # The workers still hold the request's state: one more step tells them to drop it.
                self._needs_flush = True
        elif isinstance(cmd, _Inspect):
            try:
                result = cmd.fn(self.engine)
            except Exception as e:
                cmd.done(error=e)
            else:
                cmd.done(result)
        else:
            self._check_workers()
            cmd.done()

    def _check_workers(self) -> None:
        outcome = self.runner.check_health()
        if outcome is not None:
            self._carry_out(outcome)

    def _restart_workers(self) -> None:
        """After the runner's state machine chose to restart: every request has failed already."""
        failed = self.runner.recover()
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
            outputs = self.runner.step(max_in_flight)
        except StepFailed as failed:   # the runner has dealt with it: its requests end with its account of it
            self._carry_out(failed.outcome)
            return
        finally:
            self._step_started = None
        seconds = time.perf_counter() - t0
        self._needs_flush = False
        stats = self.runner.last_stats
        items: list[tuple[Handle, RequestOutput | BaseException]] = []
        with self._cv:
            self._stats = {**stats, "steps_run": self._stats["steps_run"] + 1}
            self._in_flight = stats.get("batches_in_flight", 0)
            if credited:
                self._credited_steps += 1
            for out in outputs:
                rid = out.request_id
                handle = self._live.pop(rid, None) if out.finished else self._live.get(rid)
                if handle is None or self._requests.get(rid) is not handle:   # aborted meanwhile
                    continue
                if out.finished:
                    del self._requests[rid]
                    if out.outputs[0].finish_reason == "error":
                        out = RequestFailedError(out.outputs[0].error, out.outputs[0].error_kind)
                items.append((handle, out))
        if items:
            self._deliver(items)
        for fn in self._step_listeners:
            try:
                fn(seconds, stats)
            except Exception:
                logger.exception("step listener %r failed", fn)

    def _settle_waiters_locked(self) -> None:
        keep, dead, paused = [], self.dead_error, self.runner.state is State.PAUSED
        for w in self._waiters:
            if dead is not None:
                w.done(error=dead)
            elif self._stopping or not paused or not self._in_flight and (
                    w.target is None or self._credited_steps >= w.target):
                w.done()
            else:
                keep.append(w)
        self._waiters = keep

    def _carry_out(self, outcome: Outcome) -> None:
        """After a failure the runner dealt with: fail every request with the outcome's error; a restart, if
        any, is the loop's next turn."""
        if outcome.restart:
            with self._cv:
                self._step_credits = 0   # the new workers start serving, not paused
        self._fail_all(self._error_of(outcome))

    def _error_of(self, outcome: Outcome) -> EngineDeadError:
        """What the requests in flight end with: the engine's death, once it died, else the outcome's own."""
        return (self.dead_error if outcome.state is State.DEAD else None) or EngineDeadError(outcome.error)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._cv:
            handles, self._requests = list(self._requests.values()), {}
            # Inspections wait for the loop (a closed engine still answers them) unless it ended.
            answered = (_Ping, _Inspect) if self._ended else (_Ping,)
            waiters = [w.done for w in self._waiters] + [c.done for c in self._commands if isinstance(c, answered)]
            self._waiters = []
            self._commands = [c for c in self._commands if not isinstance(c, answered)]
        self._live.clear()
        if handles:
            self._deliver([(h, error) for h in handles])
        for done in waiters:
            done(error=error)

    def _finish(self) -> None:
        """The loop ends: whatever is left fails; the runner stops the engine (its shutdown)."""
        with self._cv:
            self._stopping = self._ended = True
            self.runner.stop("the engine was shut down")   # the first reason stays, if close() gave one
        self._fail_all(self.dead_error or EngineDeadError(self.runner.stop_reason))
