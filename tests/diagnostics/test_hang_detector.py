"""The hang detector: a driver thread over the workers' published states (always on, no --debug) that
reports a rank waiting in a collective for a peer that is not in it, once per step, within
hang-after + 5 s of the wait's start, and writes a bundle that replays up to the hung step; never while a
rank is paused in a debugger."""
import json
import os
import signal
import threading
import time
from pathlib import Path

from devharness import LLM, SamplingParams
from devharness.protocol.messages import InjectFault, PausedInfo, WorkerState
from devharness.diagnostics.hang import HangDetector
from tests.helpers import stop_process, wait_until
from tests.diagnostics.test_hang import stopped_pid  # noqa: F401  (a fixture)


def test_a_stalled_rank_is_reported_once_naming_it_and_the_collective(tmp_path):
    hang_after = 1.5
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64, hang_after_s=hang_after, inject="stall:step=3:rank=1:seconds=5",
             bundle_dir=str(tmp_path)) as llm:
        out, seen = _generate_watching(llm, [{"prompt_token_ids": [1, 2, 3]}], params)
        events = list(llm.runner.hang_detector.events)
        stats = stats_when(llm, lambda s: s["hang"] is None, 10, "the hang to be over")
    assert len(out[0].outputs[0].token_ids) == 6          # the stall ended and the run went on
    assert len(events) == 1, events
    [e] = events
    assert e.step == 3 and e.waiting == (0,) and [b.rank for b in e.missing] == [1]
    assert "layer 0 attention all_reduce" in e.where
    assert hang_after <= e.detected - e.since <= hang_after + 5
    # The stats named it while the step was held up, and no more once it went on.
    assert seen["hang"] == e.describe() and "rank(s) 0 have waited" in e.describe()
    assert stats["hang"] is None
    # The event wrote a bundle, while the step was still stalled.
    [bundle] = list(tmp_path.iterdir())
    assert stats["bundle"] == str(bundle)
    summary = json.loads((bundle / "bundle.json").read_text())
    assert summary["reason"] == "hang" and summary["time"] - e.since <= hang_after + 5
    assert [m["rank"] for m in summary["hang"]["missing"]] == [1] and "all_reduce" in summary["hang"]["where"]
    assert summary["failing_step"] == 3 and summary["steps"] == [1, 3]
    hang_txt = (bundle / "hang.txt").read_text()
    assert "did not arrive: rank 1" in hang_txt and "waiting: rank 0" in hang_txt
    assert "stall" in (bundle / "rank1" / "stacks.txt").read_text()     # caught inside the planted sleep
    # It replays up to the hung step, on another layout too.
    from devharness.engine.replay import replay
    result = replay(bundle, tensor_parallel_size=1, distributed_executor_backend="uni", inject="none")
    assert result.ok and result.last_step == 3 and result.recorded_error_kind == "unfinished", result.verdict()
    assert "step 3, unfinished in the recording, ran to its end here" in result.verdict()


def test_a_stall_at_tp_1_holds_up_the_neighbouring_stage(tmp_path):
    # At tp = 1 there is no all-reduce: the stall sits before the rank's pipeline send (first stage) or
    # receive (last stage), where the other stage waits for it. One engine: the second stall is planted
    # (InjectFault, as --inject does) after the first one's run.
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM("tiny-llama", pipeline_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64, hang_after_s=1.0, inject="stall:step=2:rank=0:seconds=3",
             bundle_dir=str(tmp_path)) as llm:
        for stalled, waiter, where in [(0, 1, "activations from rank 0"),    # rank 1 waits in its recv
                                       (1, 0, "activations to rank 1")]:     # rank 0 waits in its send
            if stalled == 1:
                step = llm.engine.core.scheduler.step_count + 2
                assert llm.engine.workers.control(InjectFault(f"stall:step={step}:rank=1:seconds=3")) == [False, True]
            else:
                step = 2
            seen = len(llm.runner.hang_detector.events)
            out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)
            assert len(out[0].outputs[0].token_ids) == 4
            events = list(llm.runner.hang_detector.events)[seen:]
            assert len(events) == 1, events
            [e] = events
            assert e.step == step and e.waiting == (waiter,) and [b.rank for b in e.missing] == [stalled], e.describe()
            assert where in e.where, e.describe()


def stats_when(llm, ok, timeout_s: float, what: str) -> dict:
    """llm.stats() once ok(it) holds (a bound on a hang, not a timing)."""
    return wait_until(lambda: s if ok(s := llm.stats()) else None, timeout_s, what)


def in_thread(fn, *args):
    """fn(*args) on a thread: (the thread, a dict that gets "r", its result, or "e", what it raised)."""
    result = {}

    def run():
        try:
            result["r"] = fn(*args)
        except BaseException as e:
            result["e"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def _generate_watching(llm, prompts, params):
    """llm.generate on another thread while this one watches llm.stats(): (the outputs, the first stats that named
    a hang, or {"hang": None})."""
    t, result = in_thread(llm.generate, prompts, params)
    seen = {"hang": None}
    while t.is_alive():
        stats = llm.stats()
        if seen["hang"] is None and stats["hang"] is not None:
            seen = stats
        time.sleep(0.05)
    if "e" in result:
        raise result["e"]
    return result["r"], seen


def test_a_stopped_rank_is_named_stopped_and_after_sigcont_the_run_goes_on_unchanged(tmp_path):
    """SIGSTOP of rank 1 (tp 1, pp 0) at tp=2 x pp=2 between steps: its published state still says "idle", yet the
    hang it causes names it as stopped (process state T), with the other ranks waiting for it, within hang-after
    + 5 s; the stats show it while it lasts, its bundle holds its stacks. After SIGCONT the text is the undisturbed
    run's and the hang is cleared."""
    hang_after = 1.5
    prompt = [{"prompt_token_ids": [5, 17, 99, 3, 42, 8, 120]}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp",
             threads_per_worker=1, num_kv_blocks=64, hang_after_s=hang_after, bundle_dir=str(tmp_path)) as llm:
        reference = llm.generate(prompt, params)[0].outputs[0].token_ids
        llm.reset_prefix_cache()   # the same prompt computed again, not read from the cache
        pid = llm.engine.workers.worker_pids[1]
        stop_process(pid)
        try:
            t0 = time.time()
            t, result = in_thread(llm.generate, prompt, params)
            stats = stats_when(llm, lambda s: s["hang"] is not None, hang_after + 20, "a hang")
            e = llm.runner.hang_detector.current
            assert stats["hang"] == e.describe(), stats
            assert [(b.rank, b.why) for b in e.missing] == [(1, "stopped (SIGSTOP, process state T)")], e
            assert set(e.waiting) == {0, 2, 3}, e   # rank 0 in the all-reduce, the next stage for its activations
            assert e.describe().startswith(f"hang in step {e.step}: rank 1 (tp 1, pp 0) is stopped (SIGSTOP, "
                                           f"process state T); rank(s) 0, 2, 3 wait for it"), e.describe()
            assert e.detected - t0 <= hang_after + 5, e.describe()
            bundle = Path(stats_when(llm, lambda s: s["bundle"] is not None, 60, "the hang's bundle")["bundle"])
            assert "rank 1 (tp 1, pp 0) is stopped (SIGSTOP, process state T)" in (bundle / "hang.txt").read_text()
            stack = (bundle / "rank1" / "stacks.txt").read_text()
            assert "failed" not in stack and "is stopped" in stack and "Thread" in stack, stack
            assert json.loads((bundle / "rank1" / "state.json").read_text())["phase"] == "stopped"
            assert "r" not in result   # still held up
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(60)
        assert result["r"][0].outputs[0].token_ids == reference
        stats_when(llm, lambda s: s["hang"] is None, 10, "the hang to be over")
        assert llm.runner.hang_detector.current is None and len(llm.runner.hang_detector.events) == 1


class _Reader:
    def __init__(self, st):
        self.st = st

    def state(self):
        return self.st

    def close(self):
        pass


def test_no_event_while_a_rank_is_paused_in_a_debugger():
    now = time.time()
    waiting = WorkerState(rank=0, tp_rank=0, step=4, phase="collective", detail="layer 1 attention all_reduce",
                          phase_since=now - 60, waiting_for=[1])
    paused = WorkerState(rank=1, tp_rank=1, step=4, phase="paused", phase_since=now - 60,
                         paused=PausedInfo(reason="breakpoint", file="llama.py", line=9, since=now - 60))
    det = HangDetector("unused", 0, hang_after_s=5)
    det._readers = [_Reader(waiting), _Reader(paused)]
    assert det.check(now) is None
    det._readers[1] = _Reader(WorkerState(rank=1, tp_rank=1, step=4, phase="forward", phase_since=now - 60))
    event = det.check(now)
    assert event is not None and [b.rank for b in event.missing] == [1]
    assert det.check(now) is None                              # once per step


class _LedgerReader:
    def __init__(self, rank, led):
        self.rank, self.led = rank, led

    def read(self, last=None):
        return self.led

    def close(self):
        pass


def test_ledger_hangs_wait_while_a_rank_is_paused_and_are_named_after():
    """Rank 0's ledger holds an all-reduce rank 1 never reached; rank 1 sits at a breakpoint: no event. Once it
    is not paused (but still has not arrived), the ledgers name it, with the group and the sequence number."""
    from tests.diagnostics.test_hang import _ledger, _ops
    now = time.time()
    led0 = _ledger(0, _ops(range(1, 5)) + _ops([5], state="started"), started_ago=60)
    led1 = _ledger(1, _ops(range(1, 5)), started_ago=60)
    # _ledger dates entries from test_hang's NOW: move them to this test's clock
    for led in (led0, led1):
        for e in led.entries:
            e.created_ns = e.started_ns = int((now - 60) * 1e9)
            e.completed_ns = e.started_ns if e.state == "completed" else 0
    waiting = WorkerState(rank=0, tp_rank=0, step=7, phase="forward", detail="after layer 2 attention all_reduce",
                          phase_since=now - 60)
    paused = WorkerState(rank=1, tp_rank=1, step=7, phase="paused", phase_since=now - 60,
                         paused=PausedInfo(reason="breakpoint", file="llama.py", line=9, since=now - 60))
    det = HangDetector("unused", 0, hang_after_s=5)
    det._readers = [_Reader(waiting), _Reader(paused)]
    det._ledgers = [_LedgerReader(0, led0), _LedgerReader(1, led1)]
    assert det.check(now) is None
    det._readers[1] = _Reader(WorkerState(rank=1, tp_rank=1, step=7, phase="forward", phase_since=now - 60))
    event = det.check(now)
    assert (event.kind, event.group, event.seq, event.waiting) == ("hang", "tp0", 5, (0,))
    assert [b.rank for b in event.missing] == [1] and det.check(now) is None   # once


def test_the_detector_names_the_stopped_rank_not_the_stage_waiting_for_its_peer(stopped_pid):
    """The ledgers show rank 2's receive that rank 0 never sent (rank 0 sits in an all-reduce with rank 1, which
    was stopped inside it): the event names rank 1, stopped, and ranks 0, 2 and 3 waiting for it; it is the
    current one until every rank went past its step, or the workers failed."""
    from tests.diagnostics.test_hang import NOW, _p2p, worker
    in_it = dict(phase="collective", detail="layer 3 all_reduce", phase_since=NOW - 30)
    states = [worker(0, pid=os.getpid(), **in_it), worker(1, pid=stopped_pid, **in_it),
              worker(2, phase="recv", detail="hidden states", phase_since=NOW - 30),
              worker(3, phase="recv", detail="hidden states", phase_since=NOW - 30)]
    det = HangDetector("unused", 0, hang_after_s=5)
    det._readers = [_Reader(st) for st in states]
    det._ledgers = [_LedgerReader(0, _p2p(0, [(1, "send", "completed")], "3", [0, 2], 30)),
                    _LedgerReader(2, _p2p(2, [(1, "recv", "completed"), (2, "recv", "started")], "3", [0, 2], 30))]
    e = det.check(NOW)
    assert (e.kind, e.group, e.seq, e.waiting) == ("hang", "pp0", 2, (0, 2, 3)), e
    assert [b.named() for b in e.missing] == ["rank 1 (tp 1, pp 0) is stopped (SIGSTOP, process state T)"]
    assert e.describe().startswith("hang in step 57: rank 1 (tp 1, pp 0) is stopped (SIGSTOP, process state T); "
                                   "rank(s) 0, 2, 3 wait for it (for 30.0 s in activations (group pp0, p2p op 2, "
                                   "recv))"), e.describe()
    assert det.current is e and det.check(NOW) is None and det.current is e   # once; current while it lasts
    # Ranks 0, 1 and 2 went on; rank 3 is still in step 57: not over yet.
    for r, st in enumerate(states[:3]):
        det._readers[r] = _Reader(worker(r, step=58, phase="forward"))
    det._readers[3] = _Reader(worker(3, phase="recv", phase_since=NOW))
    det.check(NOW)
    assert det.current is e
    det._readers[3] = _Reader(worker(3, phase="idle"))
    det.check(NOW)
    assert det.current is None and det.events == [e]
    det.current = e
    det.clear()   # the workers failed (EngineSupervisor.workers_failed)
    assert det.current is None


def test_a_hang_names_a_straggler_that_is_not_hung():
    # Rank 1 computes 30 ms longer at layer 0 every step (the straggler); then rank 0 stalls at a step: the hang is
    # rank 0's, and its text says that rank 1, late every step, is not hung.
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64, hang_after_s=1.0, inject="slow:rank=1:ms=30") as llm:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)
        step = llm.engine.core.scheduler.step_count + 4
        assert llm.engine.workers.control(InjectFault(f"stall:step={step}:rank=0:seconds=3"), [0]) == [True]
        llm.generate([{"prompt_token_ids": [4, 5, 6]}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        events = list(llm.runner.hang_detector.events)
    assert len(events) == 1, events
    [e] = events
    assert e.step == step and [b.rank for b in e.missing] == [0], e.describe()
    assert "(rank 1 is not hung but the straggler: late at layer 0 attention all_reduce (tp0) by " in e.describe()
