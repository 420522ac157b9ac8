"""The engine's life and death as a pure state machine (`Supervisor`): after a failure it decides whether the
workers restart or the engine stays dead; no threads, no clocks (callers pass the time), no I/O.
engine/runner.py's EngineRunner carries out what it decides.

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

import enum
import math
from dataclasses import dataclass


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


class StepFailed(Exception):
    """A step failed and its owner (engine/runner.py's EngineRunner) dealt with it: its bundle written, the state
    machine told. `outcome`: what the state machine decided (`outcome.error`, the text every caller of the failed
    step is given); `error`: what the step raised, led by the collective mismatch the ledgers show, if any."""

    def __init__(self, outcome: Outcome, error: BaseException):
        super().__init__(outcome.error)
        self.outcome, self.error = outcome, error


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
