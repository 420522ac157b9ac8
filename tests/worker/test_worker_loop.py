"""The worker loop (worker/worker_loop.py) that mp's processes and Ray's actors (shm control plane) both
run, tested the same way on both: typed control calls and their replies, a killed rank named within
seconds, and a hang (outside debug mode) that becomes an error within the step timeout, naming the rank
that did not arrive and the ranks that wait for it."""
import os
import re
import signal
import time

import pytest

from devharness import LLM, SamplingParams
from devharness.debug.state import StateReader
from devharness.executor.base import WorkerError
from devharness.protocol.messages import (ArmBreakpoint, BreakpointSpec, ClearBreakpoints, GetHistory, GetState, Ping,
                                 StepRecord, WorkerState)
from tests.helpers import as_inputs, mixed_prompts, stop_process, wait_until

BACKENDS = ["mp", "ray"]
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def tp2_llm(backend: str, **kw) -> LLM:
    return LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend=backend, threads_per_worker=1,
               ray_control_plane="shm", num_kv_blocks=64, **kw)


@pytest.fixture(scope="module")
def serving(ray_instance):
    """One tp=2 LLM per backend, shared by the control-call test (which leaves it serving) and the stopped-rank test
    (which ends it, and takes it out): a Ray engine costs seconds of CPU to start. The step timeout is the
    stopped-rank test's."""
    llms = {}

    def get(backend):
        if backend not in llms:
            llms[backend] = tp2_llm(backend, step_timeout_s=6)
        return llms[backend]

    get.release = lambda backend: llms.pop(backend).shutdown()
    yield get
    for llm in llms.values():
        llm.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_control_calls_and_their_typed_replies(backend, serving):
    llm = serving(backend)
    workers = llm.engine.workers
    first = [o.outputs[0].token_ids for o in llm.generate(as_inputs(mixed_prompts(2)), PARAMS)]
    states = workers.control(GetState())
    assert [type(s) for s in states] == [WorkerState, WorkerState]
    assert [(s.rank, s.tp_rank, s.pp_rank, s.pid) for s in states] == \
        [(r, r, 0, pid) for r, pid in enumerate(workers.worker_pids)]
    steps = llm.engine.core.scheduler.step_count
    # Rank 1 is not the output rank: it may still be closing its last step's record when the driver has the
    # step's tokens (a control call on Ray's shm plane does not queue behind it).
    deadline = time.monotonic() + 30
    while (history := workers.control(GetHistory(), [1])[0])[-1].step < steps and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(type(h) is StepRecord for h in history) and history[-1].step == steps
    assert workers.control(Ping(), [1]) == [1]
    # A spec naming rank 1 is kept there only; both forget it when cleared.
    assert workers.control(ArmBreakpoint(BreakpointSpec(rank=1, step=10_000))) == [False, True]
    assert workers.control(ClearBreakpoints()) == [0, 1]
    # The step path still lines up its answers with its calls after the control calls.
    assert [o.outputs[0].token_ids for o in llm.generate(as_inputs(mixed_prompts(2)), PARAMS)] == first


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_rank_is_named_within_seconds(backend, ray_instance):
    llm = tp2_llm(backend)
    try:
        llm.generate(as_inputs(mixed_prompts(2)), PARAMS)
        os.kill(llm.engine.workers.worker_pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1 \(tp 1, pp 0[^)]*\) died"):
            llm.generate(as_inputs(mixed_prompts(2)), PARAMS)
        assert time.monotonic() - killed_at < 10
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_stopped_rank_is_named_as_the_one_that_did_not_arrive(backend, serving):
    llm = serving(backend)
    try:
        llm.generate(as_inputs(mixed_prompts(2)), PARAMS)
        pid = llm.engine.workers.worker_pids[1]
        # Between steps: the last step's result came from rank 0, and rank 1 may still be finishing it.
        reader = StateReader(llm.engine.config.run_id, 1)
        wait_until(lambda: reader.state().phase == "idle", 30, "rank 1 to finish its step")
        reader.close()
        stop_process(pid)                     # rank 1 hangs between steps
        try:
            with pytest.raises(WorkerError) as info:
                llm.generate(as_inputs(mixed_prompts(2)), PARAMS)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        serving.release(backend)
    msg = str(info.value)
    # Named as stopped (not "never started step 5", which a rank hung in its own code would be), with where it was.
    assert re.search(r"did not arrive: rank 1 \(tp 1, pp 0\) is stopped \(SIGSTOP, process state T\), was in idle, "
                     r"step \d+ \|", msg), msg
    if backend == "mp":   # under Ray, rank 0's own collective timeout may end its wait first
        assert "rank 0 (tp 0, pp 0) collective" in msg and "waiting for [1]" in msg, msg
