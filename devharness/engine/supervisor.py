"""The engine's life and death, in one place.

`Supervisor` decides, after a failure, whether the workers restart or the engine stays dead: a pure state machine,
no threads, no clocks (callers pass the time), no I/O. `EngineSupervisor` owns an engine's life around it: it
starts the engine, runs its hang detector, writes its bundles, looks at its workers' health, restarts them when
the state machine says so, removes the workers' run files, and shuts everything down. It starts the engine loop
(engine/engine_loop.py's EngineLoop, the thread that steps the engine: it takes commands and applies what the
state machine decides: fail every request, restart, die), which AsyncLLM bridges to asyncio. LLM.generate steps
the engine on the caller's thread and reports to it the same way. Neither LLMEngine nor EngineCore restarts or
tidies up on its own: they restart when told.

    STARTING --started--> SERVING <--pause/resume--> PAUSED
    SERVING, PAUSED --workers_failed--> RESTARTING   (restart_workers on, fewer than max_restarts in a row)
                                    \-> DEAD         (restart_workers off, or max_restarts in a row reached)
    RESTARTING --restart_done--> SERVING (never PAUSED: the new workers serve)
    RESTARTING --restart_failed or workers_failed--> DEAD
    any --stop--> STOPPING --stopped--> STOPPED       (a failure while stopping restarts nothing)
    any --crashed--> DEAD                             (the engine loop itself failed: no restart; while restarting,
                                                       its error names the restart's cause too; while stopping,
                                                       it stays STOPPING with the crash as its error)

A restart "in a row" is one with no step completed since the one before it: step_completed resets the count,
so a crash loop (new workers that die before they serve a step) ends with the engine dead, naming the cause.
"""
from __future__ import annotations

import copy
import enum
import logging
import math
import os
import signal
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

import msgspec

from devharness.debug.state import remove_run_files
from devharness.executor.base import WorkerError

logger = logging.getLogger(__name__)


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    PAUSED = "paused"
    RESTARTING = "restarting"
    DEAD = "dead"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Unavailable(RuntimeError):
    """The engine cannot do what was asked in its state (dead, stopping, restarting); the message says why."""

    def __init__(self, message: str, state: State):
        super().__init__(message)
        self.state = state


@dataclass(frozen=True)
class Outcome:
    """What the owner does after a failure was reported."""
    state: State        # the supervisor's state afterwards
    error: str          # what the requests in flight end with
    restart: bool       # stop whatever is left of the workers, start a fresh set, report how it went
    bundle: bool        # write a failure bundle: the first failed step of this set of workers


_LIVE = (State.SERVING, State.PAUSED)
_ENDING = (State.STOPPING, State.STOPPED)


class Supervisor:
    """The engine's life and death; see the module docstring for its states and events."""

    def __init__(self, restart_workers: bool, max_restarts: int):
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 1:
            raise ValueError(f"max_restarts={max_restarts!r} must be an integer >= 1")
        self.restart_workers, self.max_restarts = restart_workers, max_restarts
        self.state = State.STARTING
        self.error: str | None = None          # why the engine died; kept through STOPPING and STOPPED
        self.cause: str | None = None          # the failure the workers are restarting after (RESTARTING)
        self.stop_reason: str | None = None
        self.restart_began = 0.0               # the `now` of the failure that began the restart
        self.restarts: list[dict] = []         # {"cause", "seconds", "time"} of each restart that succeeded
        self.restarts_in_a_row = 0             # restarts since the last step that completed
        self.workers_usable = False            # a set of workers is up and has not failed yet

    # -- what the owner asks -------------------------------------------------------------------

    @property
    def state_name(self) -> str:
        """The state as stats and /health name it: running, paused, restarting, stopped or dead (an engine that
        died stays "dead" once stopped)."""
        if self.error is not None:
            return "dead"
        if self.state in _ENDING:
            return "stopped"
        return {State.RESTARTING: "restarting", State.PAUSED: "paused"}.get(self.state, "running")

    @property
    def checks_health(self) -> bool:
        """Whether a look at the workers' health can tell anything: they serve (or are paused)."""
        return self.state in _LIVE and self.workers_usable

    def refusal(self) -> str | None:
        """Why a new request, pause or resume is refused now; None when it is not."""
        if self.error is not None:
            return self.error
        if self.state in _ENDING:
            return self.stop_reason
        if self.state is State.RESTARTING:
            return self.restarting_message()
        if self.state is State.STARTING:
            return "the workers are starting"
        return None

    def restarting_message(self) -> str:
        cause = self.cause   # read first: another thread may be ending the restart (state first, then cause)
        return "" if cause is None or self.state is not State.RESTARTING else \
            f"the workers are restarting after a failure ({cause})"

    def retry_after_s(self, now: float, expected_s: float) -> int:
        """While restarting: whole seconds until the restart should be done, given that the workers took
        `expected_s` to start last time; at least 1."""
        return max(1, math.ceil(expected_s - (now - self.restart_began)))

    # -- events --------------------------------------------------------------------------------

    def started(self) -> None:
        """The first set of workers is up."""
        self._expect("started", State.STARTING)
        self.state, self.workers_usable = State.SERVING, True

    def pause(self) -> None:
        self._raise_if_unavailable()
        self.state = State.PAUSED

    def resume(self) -> None:
        self._raise_if_unavailable()
        self.state = State.SERVING

    def step_completed(self) -> None:
        """These workers served a step: whatever killed the ones before is behind."""
        self.restarts_in_a_row = 0

    def workers_failed(self, cause: str, now: float, in_step: bool = True) -> Outcome:
        """A worker died (executor.base.WorkerDied), or a step failed and left the workers unusable, or a health
        check found one gone. `in_step`: a failed step, which a bundle can show (its last steps, the stacks)."""
        first = in_step and self.workers_usable   # this set of workers' first failure: bundled once
        if self.state in _ENDING:   # nothing restarts while stopping; what still runs fails with this
            self.workers_usable = False
            return Outcome(self.state, cause, restart=False, bundle=first)
        if self.state is State.DEAD:
            return Outcome(State.DEAD, self.error, restart=False, bundle=False)
        if self.state is State.RESTARTING:   # the new workers failed before the restart was reported done
            return self.restart_failed(cause)
        self.workers_usable = False
        if self.state is State.STARTING:
            return self._die(cause, bundle=first)
        if not self.restart_workers:
            return self._die(cause, bundle=first)
        if self.restarts_in_a_row >= self.max_restarts:
            return self._die(f"{cause} (not restarting again: the workers were restarted {self.restarts_in_a_row} "
                             f"time(s) in a row and died each time before completing a step; --max-worker-restarts "
                             f"{self.max_restarts})", bundle=first)
        self.state, self.cause, self.restart_began = State.RESTARTING, cause, now
        return Outcome(State.RESTARTING, f"{cause} (the workers are restarting; send it again shortly)",
                       restart=True, bundle=first)

    def restart_done(self, now: float, wall_time: float) -> dict:
        """The fresh workers are up: serve again (not paused). Returns the restart's record."""
        self._expect("restart_done", State.RESTARTING, *_ENDING)
        record = {"cause": str(self.cause), "seconds": round(now - self.restart_began, 3), "time": wall_time}
        self.restarts.append(record)
        self.restarts_in_a_row += 1
        self.workers_usable = True   # the next failure is a new story, with a bundle of its own
        if self.state is State.RESTARTING:
            self.state, self.cause = State.SERVING, None
        return record

    def restart_failed(self, error: str) -> Outcome:
        """Starting the fresh workers failed (`error`): the engine stays dead, naming both failures."""
        if self.state in _ENDING:
            self.workers_usable = False
            return Outcome(self.state, self.stop_reason or error, restart=False, bundle=False)
        self._expect("restart_failed", State.RESTARTING)
        self.workers_usable = False
        return self._die(f"restarting the workers failed ({error}) after: {self.cause}", bundle=False)

    def crashed(self, cause: str) -> Outcome:
        """The engine loop itself failed (a bug): dead, with no restart; while stopping, it stays stopping. During
        a restart the error names the failure the workers were restarting after too (no restart completes)."""
        self.workers_usable = False
        if self.error is None:
            self.error = cause if self.state is not State.RESTARTING else \
                f"{cause} (while the workers restarted after: {self.cause})"
        if self.state not in _ENDING:
            self.state, self.cause = State.DEAD, None
        return Outcome(self.state, self.error, restart=False, bundle=False)

    def stop(self, reason: str) -> None:
        """Shutdown began: refuse everything with `reason` (or the death that came first); no more restarts."""
        if self.state in _ENDING:
            return
        self.state, self.stop_reason = State.STOPPING, reason

    def stopped(self) -> None:
        """The workers are stopped and their files gone."""
        if self.stop_reason is None:
            self.stop_reason = "the engine was shut down"
        self.state, self.workers_usable, self.cause = State.STOPPED, False, None

    # -- helpers -------------------------------------------------------------------------------

    def _die(self, error: str, bundle: bool) -> Outcome:
        self.state, self.error, self.cause = State.DEAD, error, None
        return Outcome(State.DEAD, error, restart=False, bundle=bundle)

    def _raise_if_unavailable(self) -> None:
        why = self.refusal()
        if why is not None:
            raise Unavailable(why, self.state)

    def _expect(self, event: str, *states: State) -> None:
        if self.state not in states:
            raise RuntimeError(f"supervisor: {event} in state {self.state.value} (expected "
                               f"{' or '.join(s.value for s in states)})")


class EngineSupervisor:
    """Owns one LLMEngine's life: its state machine (`machine`, a Supervisor), its hang detector, its bundles,
    health checks, worker restarts, run files and shutdown, and the loop that steps it (start_loop). `lock` guards
    `machine`; the engine loop builds its condition variable on it, so that the state and its requests change
    together. Thread-safe."""

    def __init__(self, engine, bundles=None):
        """Supervise an engine that has started. `bundles`: what writes them (monitor/bundle.py's BundleWriter
        by default)."""
        self.engine = engine
        config = engine.config
        p = config.parallel
        self.lock = threading.RLock()
        self.machine = Supervisor(p.restart_workers, p.max_worker_restarts)
        if bundles is None:
            from devharness.monitor.bundle import BundleWriter
            bundles = BundleWriter(engine)
        self.bundles = bundles
        # Interpreter exit without shutdown(): the workers' state files go too.
        self._files = weakref.finalize(self, remove_run_files, config.run_id)
        self._shut_down = False
        self.restart_error: BaseException | None = None   # what the last failed restart raised
        self.loop = None   # the engine loop, once start_loop started it
        self.hang_detector = None
        if p.world_size > 1 and p.hang_after_s > 0:
            from devharness.monitor.hang import HangDetector
            self.hang_detector = HangDetector(config.run_id, p.world_size, p.hang_after_s,
                                              on_hang=self._on_hang).start()
            engine.explain_failure = self._explained
        self.machine.started()

    @classmethod
    def start(cls, config) -> "EngineSupervisor":
        """Start an engine from `config` (an EngineConfig) and supervise it. Workers that started and then failed
        may have left their state files: a start that fails removes them."""
        from devharness.engine.llm_engine import LLMEngine
        d, p = config.debug, config.parallel
        if d.enabled and p.distributed_executor_backend in ("uni", "mp"):   # every rank on this machine
            from devharness.debug.debugger import check_ports_free
            check_ports_free(d.host, d.port_base, range(p.world_size))
        if not config.run_id:
            config = msgspec.structs.replace(config, run_id=uuid.uuid4().hex[:12])
        try:
            engine = LLMEngine(config)
        except BaseException:
            remove_run_files(config.run_id)
            raise
        return cls(engine)

    def start_loop(self, deliver) -> "EngineLoop":
        """Start the thread that steps the engine (engine/engine_loop.py); `deliver(items)` gets each step's
        outputs. The loop ends with this supervisor's shutdown, on its own thread."""
        from devharness.engine.engine_loop import EngineLoop
        self.loop = EngineLoop(self, deliver).start()
        return self.loop

    # -- what other threads read ---------------------------------------------------------------

    def live_stats(self) -> dict:
        """The hang going on (None once the step it held up ended) and the last bundle written: safe to read while
        a step runs."""
        hang = self.current_hang()
        return {"hang": hang.describe() if hang is not None else None, "bundle": self.bundles.last}

    def current_hang(self):
        """The hang detector's event (monitor/hang.py's HangEvent) for a step still held up; None when none."""
        return self.hang_detector.current if self.hang_detector is not None else None

    # -- bundles -------------------------------------------------------------------------------

    def write_bundle(self, reason: str = "requested") -> str:
        """Write a bundle now (the last steps, every worker's state, history, log and stacks); its path."""
        return str(self.bundles.write(reason))

    def _bundle_quietly(self, reason: str, **why) -> None:
        try:
            self.bundles.write(reason, **why)
        except Exception:   # a bundle that cannot be written must not hide the failure it was for
            logger.exception("could not write a bundle (%s)", reason)

    def _on_hang(self, event) -> None:
        self._bundle_quietly("mismatch" if event.kind == "mismatch" else "hang", hang=event)
        if event.kind == "mismatch":
            self._end_mismatched(event)

    def _end_mismatched(self, event) -> None:
        """The ranks of a group paired the wrong collectives: every number from there on is wrong, and gloo hangs or
        crashes on it sooner or later. End the step now: stop that group's workers (the step then fails, naming
        the mismatch, and the workers restart or the engine dies, as for any dead worker)."""
        pids = self.engine.workers.worker_pids
        for rank in sorted({*event.waiting, *(b.rank for b in event.missing)}):
            if rank < len(pids) and pids[rank]:
                try:
                    os.kill(pids[rank], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        logger.error("ended the step: %s", event.describe())

    def _explained(self, e: WorkerError) -> WorkerError:
        """A failed step's error, led by the mismatch the collective ledgers show, if any: "rank 1 died" says
        less than which collectives the ranks paired wrongly."""
        try:
            event = self.hang_detector.explain()
        except Exception:
            logger.debug("could not read the collective ledgers", exc_info=True)
            return e
        if event is None:
            return e
        named = copy.copy(e)
        named.args = (f"{event.describe()} (then: {e})",)
        return named

    # -- failures ------------------------------------------------------------------------------

    def workers_failed(self, cause: str, step_error: str | None = None) -> Outcome:
        """Report a failure (a failed step: `step_error`, what it raised; else a death found between steps) and
        write the bundle the state machine asks for. The caller fails its requests with the outcome's error and,
        if `outcome.restart`, calls restart()."""
        with self.lock:
            outcome = self.machine.workers_failed(cause, time.monotonic(), in_step=step_error is not None)
        if self.hang_detector is not None:   # the step it held up ended with these workers
            self.hang_detector.clear()
        if outcome.bundle:
            self._bundle_quietly("worker error", error=step_error)
        return outcome

    def check_health(self) -> Outcome | None:
        """Look at the workers (without waiting on them) if they serve; a failure's outcome, or None."""
        with self.lock:
            if not self.machine.checks_health:
                return None
        try:
            self.engine.check_health()
        except Exception as e:
            return self.workers_failed(f"health check failed: {type(e).__name__}: {e}")
        return None

    def restart(self) -> Outcome | None:
        """Start a fresh set of workers after the failure the machine is restarting after (every request ends);
        None once they serve, else the outcome of the failed restart (the engine is dead; `restart_error` holds
        what starting them raised)."""
        cause = self.machine.cause
        logger.warning("restarting the workers after: %s", cause)
        try:
            self.engine.restart_workers(f"the engine failed and its workers are restarting: {cause}")
        except Exception as e:
            self.restart_error = e
            if not self._shut_down:
                logger.exception("restarting the workers failed")
            with self.lock:
                return self.machine.restart_failed(f"{type(e).__name__}: {e}")
        with self.lock:
            record = self.machine.restart_done(time.monotonic(), time.time())
        logger.warning("serving again %.1f s after: %s", record["seconds"], cause)
        return None

    # -- the end -------------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """Refuse everything from now on with `reason`; nothing restarts."""
        with self.lock:
            self.machine.stop(reason)

    def shutdown(self, force: bool = False) -> None:
        """Stop the hang detector, the workers and the bundle writer, and remove the workers' run files; safe to
        call twice (a second call does nothing). `force`: a step may still be running on another thread (a rank
        paused or hung): stop the workers without waiting for it. With an engine loop running on another thread,
        the loop stops first (EngineLoop.stop) and ends with this shutdown, on its own thread."""
        loop = self.loop
        if not force and loop is not None and loop.running_elsewhere():
            loop.stop()
            return
        with self.lock:
            self.machine.stop("the engine was shut down")
            if self._shut_down:
                return
            self._shut_down = True
        try:
            if self.hang_detector is not None:
                self.hang_detector.stop()
            self.bundles.close()
            self.engine.shutdown(force)
        finally:
            self._files()
            with self.lock:
                self.machine.stopped()
