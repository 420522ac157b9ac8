"""EngineRunner: the one owner of a running engine, and the only code that steps it.

It privately owns the engine's state machine (engine/lifecycle.py's Supervisor, which decides after a failure
whether the workers restart or the engine stays dead), its hang detector, its bundles, its workers' health checks
and restarts, their run files, and its shutdown. A step (`step`), a failed step, a restart (`recover`) and a
shutdown are each written once, here, whichever front drives it:

- inline, on the caller's thread: LLM.generate calls `run_until_idle`, which steps until its requests finished and
  no batch is in flight (nothing runs on the workers between calls), and raises a failed step's error after the
  restart, if any;
- on a thread of its own: `start_thread` starts engine/engine_loop.py's EngineLoop, which takes commands from any
  thread (AsyncLLM's, the server's) and calls `step`, `check_health` and `recover` between them.

Everything else reads the runner (its state, `live_stats`) and never the engine off the thread that steps it.
Neither LLMEngine nor EngineCore restarts or tidies up on its own: they restart when the runner tells them.
"""
from __future__ import annotations

import copy
import logging
import os
import signal
import threading
import time
import traceback
import uuid
import weakref

import msgspec

from devharness.debug.state import remove_run_files
from devharness.engine.engine_loop import ENGINE_SHUTDOWN_S, SHUTDOWN_STEP_WAIT_S, EngineLoop
from devharness.engine.lifecycle import Outcome, State, StepFailed, Supervisor, Unavailable  # noqa: F401 (the engine's states)
from devharness.protocol.errors import WorkerError

logger = logging.getLogger(__name__)
# Bundles written for stalls (engine/request_story.py) in one engine's life, each stall kind and request once: a
# scheduler bug that strands every request would otherwise write one per request.
STALL_BUNDLES = 8


class EngineRunner:
    """Owns one LLMEngine's life and steps it; see the module docstring. `lock` guards the state machine; the
    engine loop builds its condition variable on it, so that the state and its requests change together. The state
    is changed only through the runner's methods. Thread-safe, but `step`, `run_until_idle`, `check_health` and
    `recover` are for the one thread that steps the engine."""

    def __init__(self, engine, bundles=None):
        """Run an engine that has started. `bundles`: what writes them (diagnostics/bundle.py's BundleWriter by
        default)."""
        self.engine = engine
        config = engine.config
        p = config.parallel
        self.lock = threading.RLock()
        self._machine = Supervisor(p.restart_workers, p.max_worker_restarts)
        if bundles is None:
            from devharness.diagnostics.bundle import BundleWriter
            bundles = BundleWriter(engine)
        self.bundles = bundles
        # Interpreter exit without shutdown(): the workers' state files go too.
        self._files = weakref.finalize(self, remove_run_files, config.run_id)
        self._shut_down = False
        self.restart_error: BaseException | None = None   # what the last failed restart raised
        self.last_stats: dict = engine.stats()             # the engine's stats after its last step
        self._thread = None   # the engine loop, once start_thread started it
        self._numerics_bundled: set[tuple] = set()   # (rank, layer, site) of each non-finite value bundled
        self._stalls_bundled: set[tuple[str, str | None]] = set()   # (kind, request id) of the stall bundles written
        self._stall_writers: list[threading.Thread] = []
        self._stall_bundles = 0
        self.hang_detector = None
        if p.world_size > 1 and p.hang_after_s > 0:
            from devharness.diagnostics.hang import HangDetector
            self.hang_detector = HangDetector(config.run_id, p.world_size, p.hang_after_s,
                                              on_hang=self._on_hang).start()
        self._machine.started()

    @classmethod
    def start(cls, config) -> "EngineRunner":
        """Start an engine from `config` (an EngineConfig) and run it. Workers that started and then failed
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

    def start_thread(self, deliver, publish_views: bool = False) -> "EngineLoop":
        """Step the engine on a thread of its own from now on (engine/engine_loop.py's EngineLoop, which takes
        commands from any thread); `deliver(items)` gets each step's outputs; `publish_views`: the loop publishes the
        engine's view before every step, for readers while a step holds it. It ends with this runner's shutdown."""
        self._thread = EngineLoop(self, deliver, publish_views).start()
        return self._thread

    # -- the state, as drivers and readers see it (any thread) -----------------------------------

    @property
    def state(self) -> State:
        return self._machine.state

    @property
    def state_name(self) -> str:
        return self._machine.state_name

    @property
    def error(self) -> str | None:
        """Why the engine died; None while it lives."""
        return self._machine.error

    @property
    def stop_reason(self) -> str | None:
        return self._machine.stop_reason

    @property
    def restarts(self) -> list[dict]:
        return self._machine.restarts

    @property
    def workers_usable(self) -> bool:
        return self._machine.workers_usable

    @property
    def checks_health(self) -> bool:
        return self._machine.checks_health

    def refusal(self) -> str | None:
        return self._machine.refusal()

    def restarting_message(self) -> str:
        return self._machine.restarting_message()

    def retry_after_s(self) -> int:
        """While restarting: whole seconds until the restart should be done, judged by how long the workers took to
        start last time; at least 1."""
        return self._machine.retry_after_s(time.monotonic(), self.engine.workers_start_s)

    def pause(self) -> None:
        """Raises Unavailable when the engine cannot pause (dead, stopping, restarting)."""
        with self.lock:
            self._machine.pause()

    def resume(self) -> None:
        with self.lock:
            self._machine.resume()

    def crashed(self, cause: str) -> Outcome:
        """The thread that steps the engine failed (a bug): dead, no restart."""
        with self.lock:
            return self._machine.crashed(cause)

    # -- what other threads read ---------------------------------------------------------------

    def live_stats(self) -> dict:
        """The hang going on (None once the step it held up ended) and the last bundle written: safe to read while
        a step runs."""
        hang = self.current_hang()
        return {"hang": hang.describe() if hang is not None else None, "bundle": self.bundles.last}

    def current_hang(self):
        """The hang detector's event (diagnostics/hang.py's HangEvent) for a step still held up; None when none."""
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

    def _bundle_stalls(self, stalls: list, stats: dict) -> None:
        """A bundle for the stalls the detector reported in this step, each stall kind and request once and at most
        STALL_BUNDLES in all. The requests' stories are read here, between steps, and `stats` (the engine's, after
        this step) with them; the rest (the workers' states, logs and stacks) is written on a thread of its own, so
        that the engine goes on stepping meanwhile."""
        stalls = [s for s in stalls if (s.kind, s.request_id) not in self._stalls_bundled]
        if not stalls:
            return
        if self._stall_bundles >= STALL_BUNDLES:
            if self._stall_bundles == STALL_BUNDLES:   # said once
                logger.warning("no more stall bundles: %d written, the most for one engine", STALL_BUNDLES)
                self._stall_bundles += 1
            return
        self._stall_bundles += 1
        self._stalls_bundled.update((s.kind, s.request_id) for s in stalls)
        try:
            requests = self.bundles.requests_now()
        except Exception:
            logger.exception("could not read the requests' stories for a stall bundle")
            return
        writer = threading.Thread(target=self._bundle_quietly, args=("stall",), daemon=True, name="stall-bundle",
                                  kwargs={"stalls": stalls, "requests": requests, "engine_stats": stats})
        self._stall_writers = [t for t in self._stall_writers if t.is_alive()] + [writer]
        writer.start()

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

    # -- stepping: the one place the engine is stepped --------------------------------------------

    def step(self, max_in_flight: int | None = None) -> list:
        """One engine step (LLMEngine.step): the outputs of the batch that came back, if one did. A step that raises
        is dealt with here, once for every front: logged, explained by the collective ledgers, reported to the state
        machine (which asks for a bundle and a restart, or death), then raised as StepFailed; the caller ends its
        requests with `outcome.error` and, if `outcome.restart`, calls `recover()`."""
        try:
            outputs = self.engine.step(max_in_flight)
        except Exception as e:
            error = self._explained(e) if isinstance(e, WorkerError) and self.hang_detector is not None else e
            if error is not e:
                error.__cause__ = e
            step = self.last_stats.get("step", 0) + 1
            if self.state not in (State.STOPPING, State.STOPPED):
                # As text: a record that kept the exception would keep its frames, and the old workers in them.
                logger.error("engine step %d failed\n%s", step, "".join(traceback.format_exception(error)).rstrip())
            what = f"{type(error).__name__}: {error}"
            raise StepFailed(self.workers_failed(f"engine step {step} failed: {what}", step_error=what), error) \
                from error
        alarm = self.engine.take_numerics_alarm()
        if alarm is not None and alarm[0] not in self._numerics_bundled:
            # Requests ended on a non-finite value; the engine goes on. One bundle per place a value is born at: a
            # weight that overflows in every step would otherwise write one every step.
            self._numerics_bundled.add(alarm[0])
            self._bundle_quietly("non-finite", error=alarm[1], numerics=alarm[2])
        alarms = self.engine.take_kv_alarms()
        if alarms:   # the requests that read the blocks ended with them; the engine goes on
            self._bundle_quietly("kv checksum", error="\n".join(alarms))
        stats = self.engine.stats()
        with self.lock:
            self._machine.step_completed()
            self.last_stats = stats
        stalls = self.engine.take_stalls()
        if stalls:
            self._bundle_stalls(stalls, stats)
        return outputs

    def run_until_idle(self, pending: set[str]) -> dict:
        """Step on the caller's thread until every request of `pending` (ids, removed as they finish) finished and
        no batch is in flight, so that nothing runs on the workers afterwards: {request id: final RequestOutput}. A
        failed step raises what it raised, with the runner's account of it (`outcome.error`, what a served request
        ends with) as a note, after the restart the state machine asked for; the requests a restart ended are
        removed from `pending`. Raises what starting the new workers raised, if that failed."""
        finals = {}
        try:
            while pending:
                for out in self.step():
                    if out.finished:
                        finals[out.request_id] = out
                        pending.discard(out.request_id)
            while self.engine.num_batches_in_flight:
                self.step()
        except StepFailed as failed:
            outcome = failed.outcome
            if outcome.restart:
                pending.clear()   # the restart ends them
                if self.recover() is not None:
                    raise self.restart_error from failed.error
            elif self.engine.config.parallel.restart_workers:
                logger.error("%s", outcome.error)
            error = failed.error
            error.add_note(outcome.error)
            raise error from error.__cause__
        return finals

    def recover(self) -> Outcome | None:
        """If the state machine chose to restart the workers: do it (every request ends). None once they serve (or
        when nothing was to restart), else the outcome of the failed restart (the engine is dead)."""
        if self.state is not State.RESTARTING:
            return None
        failed = self.restart()
        if failed is not None:
            logger.error("%s", failed.error)
        return failed

    # -- failures ------------------------------------------------------------------------------

    def workers_failed(self, cause: str, step_error: str | None = None) -> Outcome:
        """Report a failure (a failed step: `step_error`, what it raised; else a death found between steps) and
        write the bundle the state machine asks for. The caller fails its requests with the outcome's error and,
        if `outcome.restart`, calls restart()."""
        with self.lock:
            outcome = self._machine.workers_failed(cause, time.monotonic(), in_step=step_error is not None)
        if self.hang_detector is not None:   # the step it held up ended with these workers
            self.hang_detector.clear()
        if outcome.bundle:
            self._bundle_quietly("worker error", error=step_error)
        return outcome

    def check_health(self) -> Outcome | None:
        """Look at the workers (without waiting on them) if they serve; a failure's outcome, or None."""
        with self.lock:
            if not self._machine.checks_health:
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
        cause = self._machine.cause
        logger.warning("restarting the workers after: %s", cause)
        try:
            self.engine.restart_workers(f"the engine failed and its workers are restarting: {cause}")
        except Exception as e:
            self.restart_error = e
            if not self._shut_down:
                logger.exception("restarting the workers failed")
            with self.lock:
                return self._machine.restart_failed(f"{type(e).__name__}: {e}")
        with self.lock:
            record = self._machine.restart_done(time.monotonic(), time.time())
        logger.warning("serving again %.1f s after: %s", record["seconds"], cause)
        return None

    # -- the end -------------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """Refuse everything from now on with `reason`; nothing restarts."""
        with self.lock:
            self._machine.stop(reason)

    def shutdown(self, force: bool = False, timeout_s: float = SHUTDOWN_STEP_WAIT_S) -> None:
        """Stop the thread that steps the engine, if one does, then the hang detector, the workers and the bundle
        writer, and remove the workers' run files; safe to call twice (a second call does nothing). A step still
        running after `timeout_s` on the runner's thread (a rank paused in a debugger, or hung) is not waited for:
        its workers are stopped under it, the step fails and the thread ends. `force`: stop the workers without
        waiting for a step at all."""
        thread = self._thread
        if thread is not None and not force:
            if thread.end(timeout_s) and thread.step_running_s() is not None:
                # Its workers must not outlive the caller: stopped from here, the step fails and the thread ends.
                logger.warning("step %d still running after %.0f s (a rank paused or hung): stopping the workers "
                               "without waiting for it", self.last_stats.get("step", 0) + 1, timeout_s)
                force = True
                self._stop_everything(force)
            if thread.end(ENGINE_SHUTDOWN_S):
                logger.error("the engine loop did not stop; shutting the workers down anyway")
                force = True
        self._stop_everything(force)

    def _stop_everything(self, force: bool) -> None:
        with self.lock:
            self._machine.stop("the engine was shut down")
            if self._shut_down:
                return
            self._shut_down = True
        try:
            if self.hang_detector is not None:
                self.hang_detector.stop()
            for writer in self._stall_writers:   # a stall bundle reads the workers: before they stop
                writer.join(ENGINE_SHUTDOWN_S)
            self.bundles.close()
            self.engine.shutdown(force)
        finally:
            self._files()
            with self.lock:
                self._machine.stopped()
