"""The engine's life and death, in one place.

`Supervisor` (engine/lifecycle.py) decides, after a failure, whether the workers restart or the engine stays dead:
a pure state machine. `EngineSupervisor` owns an engine's life around it: it starts the engine, runs its hang
detector, writes its bundles, looks at its workers' health, restarts them when the state machine says so, removes
the workers' run files, and shuts everything down. It starts the engine loop
(engine/engine_loop.py's EngineLoop, the thread that steps the engine: it takes commands and applies what the
state machine decides: fail every request, restart, die), which AsyncLLM bridges to asyncio. LLM.generate steps
the engine on the caller's thread and reports to it the same way. Neither LLMEngine nor EngineCore restarts or
tidies up on its own: they restart when told.
"""
from __future__ import annotations

import copy
import logging
import os
import signal
import threading
import time
import uuid
import weakref

import msgspec

from devharness.debug.state import remove_run_files
from devharness.engine.lifecycle import Outcome, State, Supervisor, Unavailable  # noqa: F401 (the engine's states)
from devharness.protocol.errors import WorkerError

logger = logging.getLogger(__name__)


class EngineSupervisor:
    """Owns one LLMEngine's life: its state machine (`machine`, a Supervisor), its hang detector, its bundles,
    health checks, worker restarts, run files and shutdown, and the loop that steps it (start_loop). `lock` guards
    `machine`; the engine loop builds its condition variable on it, so that the state and its requests change
    together. Thread-safe."""

    def __init__(self, engine, bundles=None):
        """Supervise an engine that has started. `bundles`: what writes them (diagnostics/bundle.py's BundleWriter
        by default)."""
        self.engine = engine
        config = engine.config
        p = config.parallel
        self.lock = threading.RLock()
        self.machine = Supervisor(p.restart_workers, p.max_worker_restarts)
        if bundles is None:
            from devharness.diagnostics.bundle import BundleWriter
            bundles = BundleWriter(engine)
        self.bundles = bundles
        # Interpreter exit without shutdown(): the workers' state files go too.
        self._files = weakref.finalize(self, remove_run_files, config.run_id)
        self._shut_down = False
        self.restart_error: BaseException | None = None   # what the last failed restart raised
        self.loop = None   # the engine loop, once start_loop started it
        self.hang_detector = None
        if p.world_size > 1 and p.hang_after_s > 0:
            from devharness.diagnostics.hang import HangDetector
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
