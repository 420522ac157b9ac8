"""The Supervisor (engine/supervisor.py), the one place that decides restart or death: every transition, with the
outcomes the restart tests (tests/server/test_restart.py, tests/engine/test_restart.py) assert end to end: a death
while serving or paused restarts the workers (or, without restart_workers, leaves the engine dead naming the cause),
a failed restart leaves it dead naming both failures, nothing restarts while stopping, and a crash loop ends dead
after --max-worker-restarts restarts in a row with no step completed between them. Then the same through AsyncLLM,
on a stand-in engine, and the typed WorkerDied that executors raise."""
import asyncio
import pickle
import threading
import time

import pytest

from devharness.engine.async_llm import AsyncLLM, EngineDeadError, EngineRestartingError
from devharness.engine.lifecycle import State, Supervisor, Unavailable
from devharness.engine.runner import EngineRunner
from devharness.executor.base import WorkerDied, WorkerError

DEATH = "engine step 5 failed: WorkerDied: step 5: rank 1 (tp 1, pp 0, pid 4242) died (killed by SIGKILL)"


def serving(restart=True, max_restarts=3) -> Supervisor:
    sup = Supervisor(restart, max_restarts)
    sup.started()
    return sup


def restarted(sup: Supervisor, cause: str = DEATH, now: float = 10.0) -> dict:
    out = sup.workers_failed(cause, now)
    assert out.state is State.RESTARTING and out.restart, out
    return sup.restart_done(now + 2.5, 1234.0)


# -- start, pause, resume ---------------------------------------------------------------------------------------

def test_starting_refuses_until_the_workers_are_up_then_serves():
    sup = Supervisor(True, 3)
    assert sup.state is State.STARTING and sup.refusal() == "the workers are starting" and not sup.checks_health
    with pytest.raises(Unavailable):
        sup.pause()
    sup.started()
    assert sup.state is State.SERVING and sup.refusal() is None and sup.checks_health
    assert sup.state_name == "running" and sup.error is None
    with pytest.raises(RuntimeError, match="started in state serving"):
        sup.started()


def test_a_failure_while_starting_is_death_without_a_restart():
    sup = Supervisor(True, 3)
    out = sup.workers_failed(DEATH, 1.0)
    assert (out.state, out.restart, out.error) == (State.DEAD, False, DEATH) and sup.state_name == "dead"


def test_pause_and_resume():
    sup = serving()
    sup.pause()
    assert sup.state is State.PAUSED and sup.state_name == "paused" and sup.refusal() is None and sup.checks_health
    sup.pause()   # pausing a paused engine (step_once) keeps it paused
    assert sup.state is State.PAUSED
    sup.resume()
    assert sup.state is State.SERVING and sup.state_name == "running"
    sup.resume()
    assert sup.state is State.SERVING


@pytest.mark.parametrize("max_restarts", [0, -1, True, 1.5])
def test_max_restarts_must_be_a_positive_integer(max_restarts):
    with pytest.raises(ValueError, match="max_restarts"):
        Supervisor(True, max_restarts)


# -- worker death while serving, while paused ------------------------------------------------------------------

@pytest.mark.parametrize("paused", [False, True])
def test_worker_death_restarts_the_workers(paused):
    sup = serving()
    if paused:
        sup.pause()
    out = sup.workers_failed(DEATH, now=100.0)
    assert out.state is State.RESTARTING and sup.state is State.RESTARTING and out.restart and out.bundle
    # The requests in flight end with the cause and are told to come back; new ones get the restart's message.
    assert out.error == f"{DEATH} (the workers are restarting; send it again shortly)"
    assert sup.refusal() == sup.restarting_message() == f"the workers are restarting after a failure ({DEATH})"
    assert sup.state_name == "restarting" and sup.error is None and not sup.checks_health and not sup.workers_usable
    assert "rank 1 (tp 1, pp 0" in sup.refusal()
    # Retry-After: what is left of the last start-up's time, at least 1 s.
    assert sup.retry_after_s(now=101.0, expected_s=5.2) == 5
    assert sup.retry_after_s(now=110.0, expected_s=5.2) == 1
    with pytest.raises(Unavailable, match="restarting after a failure") as info:
        sup.pause()
    assert info.value.state is State.RESTARTING
    with pytest.raises(Unavailable):
        sup.resume()
    record = sup.restart_done(now=103.25, wall_time=5555.0)
    assert record == {"cause": DEATH, "seconds": 3.25, "time": 5555.0} and sup.restarts == [record]
    # The new workers serve, paused or not before: a pause does not outlive the workers it held.
    assert sup.state is State.SERVING and sup.state_name == "running" and sup.restarts_in_a_row == 1
    assert sup.refusal() is None and sup.checks_health and sup.restarting_message() == ""


@pytest.mark.parametrize("paused", [False, True])
def test_worker_death_without_restart_workers_is_death(paused):
    sup = serving(restart=False)
    if paused:
        sup.pause()
    out = sup.workers_failed(DEATH, now=1.0)
    assert (out.state, out.restart, out.bundle, out.error) == (State.DEAD, False, True, DEATH)
    assert sup.state is State.DEAD and sup.state_name == "dead" and sup.error == DEATH == sup.refusal()
    assert not sup.checks_health and not sup.workers_usable and sup.restarts == []
    with pytest.raises(Unavailable, match="killed by SIGKILL") as info:
        sup.resume()
    assert info.value.state is State.DEAD


def test_dead_stays_dead_and_bundles_once():
    sup = serving(restart=False)
    assert sup.workers_failed(DEATH, 1.0).bundle
    again = sup.workers_failed("engine step 6 failed: WorkerError: the mp executor stopped", 2.0)
    assert (again.state, again.restart, again.bundle, again.error) == (State.DEAD, False, False, DEATH)
    assert sup.error == DEATH


def test_only_a_failed_step_is_bundled_once_per_set_of_workers():
    sup = serving()
    # A death a health check found has no step to show: no bundle.
    assert not sup.workers_failed("health check failed: WorkerDied: rank 1 died", 1.0, in_step=False).bundle
    sup.restart_done(2.0, 0.0)
    assert sup.workers_failed(DEATH, 3.0).bundle    # the new workers' first failed step: a new story
    sup.restart_done(4.0, 0.0)
    assert sup.workers_failed(DEATH, 5.0).bundle


def test_a_loop_crash_is_death_even_with_restarts_on():
    sup = serving()
    out = sup.crashed("the engine loop crashed: KeyError: 'x'")
    assert (out.state, out.restart, out.bundle) == (State.DEAD, False, False)
    assert sup.error == "the engine loop crashed: KeyError: 'x'" and sup.state_name == "dead"


@pytest.mark.parametrize("before", ["starting", "paused"])
def test_a_loop_crash_while_starting_or_paused_is_death(before):
    sup = Supervisor(True, 3)
    if before == "paused":
        sup.started()
        sup.pause()
    out = sup.crashed("the engine loop crashed: KeyError: 'x'")
    assert (out.state, out.restart, out.bundle, out.error) == (State.DEAD, False, False,
                                                               "the engine loop crashed: KeyError: 'x'")
    assert sup.state is State.DEAD and sup.refusal() == sup.error and not sup.checks_health


def test_a_loop_crash_after_death_keeps_the_first_cause():
    sup = serving(restart=False)
    sup.workers_failed(DEATH, 1.0)
    out = sup.crashed("the engine loop crashed: KeyError: 'x'")
    assert (out.state, out.error) == (State.DEAD, DEATH) and sup.error == DEATH


# -- worker death during a restart -----------------------------------------------------------------------------

def test_a_restart_that_fails_is_death_naming_both_failures():
    sup = serving()
    sup.workers_failed(DEATH, 1.0)
    out = sup.restart_failed("WorkerError: start-up: rank 0 died (exit code 1)")
    assert (out.state, out.restart, out.bundle) == (State.DEAD, False, False)
    assert out.error == sup.error == (f"restarting the workers failed (WorkerError: start-up: rank 0 died (exit code 1)) "
                                      f"after: {DEATH}")
    assert sup.state_name == "dead" and sup.restarts == [] and sup.refusal() == sup.error
    with pytest.raises(RuntimeError, match="restart_done in state dead"):
        sup.restart_done(2.0, 0.0)


def test_worker_death_during_a_restart_is_a_failed_restart():
    sup = serving()
    sup.workers_failed(DEATH, 1.0)
    out = sup.workers_failed("health check failed: WorkerDied: rank 0 died", 2.0, in_step=False)
    assert out.state is State.DEAD and not out.restart
    assert sup.error == f"restarting the workers failed (health check failed: WorkerDied: rank 0 died) after: {DEATH}"


def test_a_loop_crash_during_a_restart_is_death_naming_the_restarts_cause():
    """The loop that was restarting the workers failed itself: no restart completes, the engine is dead, and its
    error names the crash and the failure the workers were restarting after (as a failed restart names both)."""
    sup = serving()
    sup.workers_failed(DEATH, 1.0)
    out = sup.crashed("the engine loop crashed: KeyError: 'x'")
    assert (out.state, out.restart, out.bundle) == (State.DEAD, False, False)
    assert out.error == sup.error == (f"the engine loop crashed: KeyError: 'x' (while the workers restarted after: "
                                      f"{DEATH})")
    assert sup.state is State.DEAD and sup.state_name == "dead" and sup.refusal() == sup.error
    assert sup.cause is None and sup.restarting_message() == "" and sup.restarts == [] and not sup.workers_usable
    # What the restart under way would report next is refused: the engine stays dead with its first error.
    with pytest.raises(RuntimeError, match="restart_done in state dead"):
        sup.restart_done(2.0, 0.0)
    with pytest.raises(RuntimeError, match="restart_failed in state dead"):
        sup.restart_failed("x")
    again = sup.workers_failed("health check failed: WorkerDied: rank 0 died", 3.0, in_step=False)
    assert (again.state, again.restart, again.error) == (State.DEAD, False, sup.error)


def test_restart_events_outside_a_restart_are_refused():
    sup = serving()
    with pytest.raises(RuntimeError, match="restart_done in state serving"):
        sup.restart_done(1.0, 0.0)
    with pytest.raises(RuntimeError, match="restart_failed in state serving"):
        sup.restart_failed("x")
    assert sup.state is State.SERVING


# -- worker death during shutdown ------------------------------------------------------------------------------

@pytest.mark.parametrize("paused", [False, True])
def test_stopping_ignores_worker_death_and_ends_stopped(paused):
    sup = serving()
    if paused:
        sup.pause()
    sup.stop("the server is shutting down")
    assert sup.state is State.STOPPING and sup.state_name == "stopped" and not sup.checks_health
    assert sup.refusal() == "the server is shutting down"
    # The step a forced shutdown broke: no restart, no death; its bundle is still written, once.
    out = sup.workers_failed("engine step 9 failed: WorkerError: shut down while a step was running", 5.0)
    assert (out.state, out.restart, out.bundle) == (State.STOPPING, False, True)
    assert sup.error is None and sup.state_name == "stopped" and not sup.workers_usable
    assert not sup.workers_failed(DEATH, 6.0).bundle
    sup.stop("the engine was shut down")   # the first reason stays
    assert sup.refusal() == "the server is shutting down"
    sup.stopped()
    assert sup.state is State.STOPPED and sup.state_name == "stopped" and sup.error is None
    assert sup.workers_failed(DEATH, 7.0).state is State.STOPPED


def test_a_loop_crash_while_stopping_stays_stopping_with_the_crash_as_its_error():
    """The docstring's "while stopping, it stays STOPPING with the crash as its error": no death state, no restart,
    but what is refused from then on, and what the engine's state reads, is the crash."""
    sup = serving()
    sup.stop("the server is shutting down")
    out = sup.crashed("the engine loop crashed: KeyError: 'x'")
    assert (out.state, out.restart, out.bundle, out.error) == (State.STOPPING, False, False,
                                                               "the engine loop crashed: KeyError: 'x'")
    assert sup.state is State.STOPPING and sup.error == out.error == sup.refusal() and sup.state_name == "dead"
    assert not sup.workers_usable and not sup.checks_health
    # A worker death after it restarts nothing either, and the crash stays the error.
    assert sup.workers_failed(DEATH, 2.0).state is State.STOPPING and sup.error == out.error
    sup.stopped()
    assert sup.state is State.STOPPED and sup.error == out.error and sup.state_name == "dead"


def test_a_loop_crash_while_stopping_after_a_death_keeps_the_death():
    sup = serving(restart=False)
    sup.workers_failed(DEATH, 1.0)
    sup.stop("the engine was shut down")
    out = sup.crashed("the engine loop crashed: KeyError: 'x'")
    assert (out.state, out.error) == (State.STOPPING, DEATH) and sup.error == DEATH


@pytest.mark.parametrize("before", ["starting", "serving", "paused", "restarting", "dead"])
def test_stop_from_any_state_is_stopping_then_stopped(before):
    sup = Supervisor(restart_workers=before != "dead", max_restarts=3)
    if before != "starting":
        sup.started()
    if before == "paused":
        sup.pause()
    if before in ("restarting", "dead"):
        sup.workers_failed(DEATH, 1.0)
    assert sup.state.value == before
    sup.stop("bye")
    assert sup.state is State.STOPPING and not sup.checks_health
    assert sup.refusal() == (DEATH if before == "dead" else "bye")
    sup.stopped()
    assert sup.state is State.STOPPED and sup.state_name == ("dead" if before == "dead" else "stopped")


def test_stop_during_a_restart_restarts_nothing_more():
    sup = serving()
    sup.workers_failed(DEATH, 1.0)
    sup.stop("the engine was shut down")
    assert sup.state is State.STOPPING and sup.refusal() == "the engine was shut down"
    # The restart under way fails as its engine shuts down: still stopping, not dead.
    out = sup.restart_failed("RuntimeError: the engine was shut down while its workers restarted")
    assert (out.state, out.restart, out.error) == (State.STOPPING, False, "the engine was shut down")
    assert sup.error is None and sup.state_name == "stopped"
    sup.stopped()
    assert sup.state is State.STOPPED


def test_a_restart_that_ends_while_stopping_counts_but_stays_stopping():
    sup = serving()
    sup.workers_failed(DEATH, 1.0)
    sup.stop("the server is shutting down")
    record = sup.restart_done(3.0, 0.0)
    assert record["cause"] == DEATH and sup.restarts == [record] and sup.state is State.STOPPING


def test_a_death_before_the_shutdown_stays_the_reason():
    sup = serving(restart=False)
    sup.workers_failed(DEATH, 1.0)
    sup.stop("the engine was shut down")
    sup.stopped()
    assert sup.state is State.STOPPED and sup.state_name == "dead" and sup.refusal() == DEATH == sup.error


# -- the restart limit -----------------------------------------------------------------------------------------

def test_restart_limit_reached_is_death_naming_the_cause():
    sup = serving(max_restarts=2)
    restarted(sup)
    restarted(sup)
    assert sup.restarts_in_a_row == 2 and len(sup.restarts) == 2
    out = sup.workers_failed(DEATH, 50.0)
    assert (out.state, out.restart) == (State.DEAD, False)
    assert out.error == sup.error == (
        f"{DEATH} (not restarting again: the workers were restarted 2 time(s) in a row and died each time before "
        f"completing a step; --max-worker-restarts 2)")
    assert "rank 1 (tp 1, pp 0" in sup.error and sup.state_name == "dead" and len(sup.restarts) == 2


def test_restart_limit_reached_while_paused_is_death_too():
    sup = serving(max_restarts=1)
    restarted(sup)
    sup.pause()
    out = sup.workers_failed(DEATH, 50.0)
    assert (out.state, out.restart) == (State.DEAD, False) and "--max-worker-restarts 1" in out.error


def test_a_completed_step_resets_the_count():
    """tests/server/test_restart.py::test_a_crash_loop_ends_with_the_engine_dead, without processes: with
    --max-worker-restarts 1, a step between two deaths lets the second restart too; a death of the new workers
    before any step ends the restarts."""
    sup = serving(max_restarts=1)
    restarted(sup)
    assert len(sup.restarts) == 1 and sup.restarts_in_a_row == 1
    sup.step_completed()
    assert sup.restarts_in_a_row == 0
    restarted(sup)
    assert len(sup.restarts) == 2 and sup.state is State.SERVING
    out = sup.workers_failed(DEATH, 90.0)
    assert out.state is State.DEAD and "not restarting again" in out.error and "--max-worker-restarts 1" in out.error
    assert len(sup.restarts) == 2


# -- the same through AsyncLLM, on a stand-in engine -------------------------------------------------------------

class _Parallel:
    def __init__(self, restart_workers, max_worker_restarts):
        self.restart_workers, self.max_worker_restarts = restart_workers, max_worker_restarts
        self.step_timeout_s = 60.0
        self.world_size, self.hang_after_s = 1, 0.0


class _Config:
    def __init__(self, **parallel):
        self.parallel = _Parallel(**parallel)
        self.model = type("M", (), {"model": "stand-in"})()
        self.debug = type("D", (), {"enabled": False})()
        self.run_id = "stand-in"


class StandInBundles:
    """What the supervisor writes bundles with: it counts them."""

    def __init__(self):
        self.written, self.closed = [], 0

    @property
    def last(self):
        return None

    def write(self, reason, error=None, hang=None):
        self.written.append((reason, error))

    def close(self):
        self.closed += 1


class StandInEngine:
    """What AsyncLLM calls on an LLMEngine, with workers that die on demand; it counts restarts and bundles."""

    def __init__(self, restart_workers=True, max_worker_restarts=3, restart_error=None):
        self.config = _Config(restart_workers=restart_workers, max_worker_restarts=max_worker_restarts)
        self.tokenizer, self.max_model_len = None, 128
        self.workers_start_s = 30.0   # how long the workers took to start (LLMEngine.workers_start_s)
        self.dead = threading.Event()
        self.restart_error = restart_error
        self.restarted = threading.Event()
        self.restart_reasons, self.bundles, self.shut_down = [], StandInBundles(), 0

    def stats(self):
        return {"step": 0}

    def take_numerics_alarm(self):
        return None

    def take_stalls(self):
        return []

    def take_kv_alarms(self):
        return []

    def check_health(self):
        if self.dead.is_set():
            raise WorkerDied("health check: rank 1 (tp 1, pp 0, pid 7) died (killed by SIGKILL)", rank=1,
                             cause="killed by SIGKILL")

    def has_unfinished_requests(self):
        return False

    def restart_workers(self, reason):
        self.restart_reasons.append(reason)
        if self.restart_error is not None:
            raise self.restart_error
        self.dead.clear()
        self.restarted.set()

    def shutdown(self, force=False):
        self.shut_down += 1


def front(engine: StandInEngine) -> AsyncLLM:
    return AsyncLLM(engine, EngineRunner(engine, bundles=engine.bundles))


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_async_llm_restarts_a_dead_worker_through_the_supervisor():
    engine = StandInEngine()
    llm = front(engine)
    try:
        assert llm.stats()["state"] == "running" and llm.stats()["restarts"] == 0
        engine.dead.set()   # the idle engine loop finds it within LIVENESS_CHECK_S
        assert engine.restarted.wait(10)
        wait_for(lambda: llm.stats()["restarts"] == 1)
        stats = llm.stats()
        assert stats["state"] == "running" and llm.dead_error is None
        assert "rank 1 (tp 1, pp 0" in stats["last_restart"]["cause"]
        assert stats["last_restart"]["cause"].startswith("health check failed: WorkerDied: ")
        assert engine.restart_reasons == [f"the engine failed and its workers are restarting: "
                                          f"{stats['last_restart']['cause']}"]
        assert engine.bundles.written == []   # a death found between steps has no step to bundle
        asyncio.run(llm.check_health())
    finally:
        llm.shutdown()
    assert engine.shut_down == 1 and llm.stats()["state"] == "stopped" and llm.state is State.STOPPED


def test_async_llm_without_restarts_stays_dead_naming_the_rank():
    engine = StandInEngine(restart_workers=False)
    llm = front(engine)
    try:
        engine.dead.set()
        wait_for(lambda: llm.dead_error is not None)
        assert llm.stats()["state"] == "dead" and engine.restart_reasons == []
        assert str(llm.dead_error).startswith("health check failed: WorkerDied: health check: rank 1 (tp 1, pp 0")
        with pytest.raises(EngineDeadError, match="rank 1") as info:
            asyncio.run(llm.pause())
        assert not isinstance(info.value, EngineRestartingError)
    finally:
        llm.shutdown()
    assert llm.stats()["state"] == "dead"   # a death before the shutdown stays the reason


def test_async_llm_refuses_while_restarting_with_retry_after():
    engine = StandInEngine()
    gate = threading.Event()
    real_restart = engine.restart_workers
    engine.restart_workers = lambda reason: (gate.wait(10), real_restart(reason))
    llm = front(engine)
    try:
        engine.dead.set()
        wait_for(lambda: llm.restarting)
        assert llm.stats()["state"] == "restarting"
        with pytest.raises(EngineRestartingError, match=r"restarting after a failure \(health check failed") as info:
            asyncio.run(llm.pause())
        assert 1 <= info.value.retry_after_s <= 30
        gate.set()
        wait_for(lambda: not llm.restarting)
        assert llm.stats()["restarts"] == 1 and llm.stats()["state"] == "running"
    finally:
        gate.set()
        llm.shutdown()


def test_async_llm_a_failed_restart_is_death():
    engine = StandInEngine(restart_error=WorkerError("start-up: rank 0 failed"))
    llm = front(engine)
    try:
        engine.dead.set()
        wait_for(lambda: llm.dead_error is not None)
        assert str(llm.dead_error).startswith("restarting the workers failed (WorkerError: start-up: rank 0 failed) "
                                              "after: health check failed: WorkerDied")
        assert llm.stats()["state"] == "dead" and llm.stats()["restarts"] == 0
    finally:
        llm.shutdown()


# -- the typed error -------------------------------------------------------------------------------------------

def test_worker_died_is_a_worker_error_that_keeps_its_rank_through_pickling():
    e = WorkerDied("step 3: rank 2 (tp 0, pp 1, pid 9) died (killed by SIGKILL)", rank=2, cause="killed by SIGKILL")
    assert isinstance(e, WorkerError)
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.rank, back.cause) == (WorkerDied, str(e), 2, "killed by SIGKILL")


# -- the owner: EngineRunner carries out what the state machine decides --------------------------------------

def test_the_owner_bundles_a_failed_step_once_and_restarts_when_told():
    engine = StandInEngine()
    sup = EngineRunner(engine, bundles=engine.bundles)
    out = sup.workers_failed(DEATH, step_error="WorkerDied: rank 1 died")
    assert out.restart and sup.state is State.RESTARTING
    assert engine.bundles.written == [("worker error", "WorkerDied: rank 1 died")]
    assert sup.restart() is None and engine.restart_reasons == [
        f"the engine failed and its workers are restarting: {DEATH}"]
    assert sup.state is State.SERVING and [r["cause"] for r in sup.restarts] == [DEATH]
    # A death found between steps (a health check) has no step to bundle.
    engine.dead.set()
    out = sup.check_health()
    assert out is not None and out.restart and out.error.startswith("health check failed: WorkerDied: ")
    assert len(engine.bundles.written) == 1
    assert sup.restart() is None and sup.check_health() is None


def test_the_owner_a_failed_restart_is_death_and_keeps_what_it_raised():
    boom = WorkerError("start-up: rank 0 failed")
    engine = StandInEngine(restart_error=boom)
    sup = EngineRunner(engine, bundles=engine.bundles)
    sup.workers_failed(DEATH, step_error="x")
    out = sup.restart()
    assert out is not None and out.state is State.DEAD and sup.restart_error is boom
    assert sup.error.startswith("restarting the workers failed (WorkerError: start-up: rank 0 failed) after")


def test_the_owner_shuts_down_once_and_removes_the_run_files(tmp_path):
    from devharness.debug.state import board_paths
    engine = StandInEngine()
    engine.config.run_id = f"stand-in-{time.monotonic_ns()}"
    sup = EngineRunner(engine, bundles=engine.bundles)
    state_file, history_file = board_paths(engine.config.run_id, 0)
    state_file.write_bytes(b"x")
    history_file.write_bytes(b"x")
    sup.stop("bye")
    with pytest.raises(Unavailable, match="bye"):
        sup.pause()
    sup.shutdown()
    sup.shutdown()
    assert engine.shut_down == 1 and engine.bundles.closed == 1
    assert not state_file.exists() and not history_file.exists()
    assert sup.state is State.STOPPED and sup.stop_reason == "bye"


def test_a_start_that_fails_removes_the_files_its_workers_left(monkeypatch):
    import msgspec

    from devharness.debug.state import board_paths
    from devharness.engine import llm_engine
    from devharness.engine.args import EngineArgs
    left = []

    class FailingEngine:
        def __init__(self, config):
            path = board_paths(config.run_id, 1)[0]   # a worker that started, then the engine failed
            path.write_bytes(b"x")
            left.append(path)
            raise RuntimeError("rank 0 failed to load the model")

    monkeypatch.setattr(llm_engine, "LLMEngine", FailingEngine)
    config = EngineArgs.from_kwargs(model="tiny-llama").create_engine_config()
    assert not config.run_id   # the supervisor names the run before it starts it
    with pytest.raises(RuntimeError, match="failed to load"):
        EngineRunner.start(msgspec.structs.replace(config))
    [path] = left
    assert not path.exists()
