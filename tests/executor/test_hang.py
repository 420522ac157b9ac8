"""Outside debug mode a hang becomes an error within the step timeout, naming the rank that did not
arrive and the ranks that wait for it."""
import os
import signal

import pytest

from devharness import LLM, SamplingParams
from devharness.debug.state import StateReader
from devharness.executor.base import WorkerError
from tests.debug.test_debug_mode import wait_until
from tests.helpers import as_inputs, mixed_prompts


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_stopped_rank_is_named_as_the_one_that_did_not_arrive(backend, ray_instance):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend=backend, threads_per_worker=1,
             num_kv_blocks=64, step_timeout_s=3) as llm:
        llm.generate(as_inputs(mixed_prompts(2)), params)
        pid = llm.engine.core.executor.worker_pids[1]
        # Between steps: the last step's result came from rank 0, and rank 1 may still be finishing it.
        reader = StateReader(llm.engine.config.run_id, 1)
        wait_until(lambda: reader.state().phase == "idle", 30, "rank 1 to finish its step")
        reader.close()
        os.kill(pid, signal.SIGSTOP)          # rank 1 hangs between steps
        try:
            with pytest.raises(WorkerError) as info:
                llm.generate(as_inputs(mixed_prompts(2)), params)
        finally:
            os.kill(pid, signal.SIGCONT)
    msg = str(info.value)
    assert "did not arrive: rank 1 (tp 1, pp 0) never started step" in msg, msg
    if backend == "mp":   # under Ray, rank 0's own collective timeout may end its wait first
        assert "rank 0 (tp 0, pp 0) collective" in msg and "waiting for [1]" in msg, msg
