"""Story: "it went wrong at step 3 of a run I cannot rerun". Record the run, replay it on another layout,
and stop there under a debugger.

`record_dir=` (`devharness generate|serve --record DIR`) writes every step message the workers got
and every token they sampled. The recording, made in one process (tp=1), is replayed on two worker
processes (tp=2, mp) with no scheduler: `replay(..., debug=True, break_at_step=3, break_rank=1)`
(`devharness replay DIR --tp 2 --debug --break-at-step 3 --break-rank 1`) stops rank 1 at the start
of step 3 with the step message `so` in scope. A DAP client (VS Code's "attach" to the port the
replay prints) reads it and continues; the replay then compares every sampled token with the
recording and gives its verdict.

Exits non-zero unless rank 1 stopped at step 3 and every replayed token matches the recording.
"""
import sys
import tempfile
import threading
import time

from _dap import DAPClient

from devharness import LLM, SamplingParams
from devharness.bench.dap import free_port_bases
from devharness.config import DebugConfig
from devharness.engine.replay import replay


def fail(why: str):
    sys.exit(f"replay_under_debugger: the story did not come out: {why}")


def attach_when_listening(port: int, seconds: float = 60.0) -> DAPClient:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return DAPClient(port)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


if __name__ == "__main__":   # the mp executor starts worker processes that import this file
    recording = tempfile.mkdtemp(prefix="devharness-recording-")
    with LLM("tiny-llama", distributed_executor_backend="uni", record_dir=recording) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, "Hello"],
                     SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    print("recorded the run in", recording)

    port_base = free_port_bases(1, 2)[0]
    result = {}
    run = threading.Thread(target=lambda: result.update(r=replay(
        recording, tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
        debug=DebugConfig(enabled=True, port_base=port_base), break_at_step=3, break_rank=1)), daemon=True)
    run.start()
    dap = attach_when_listening(port_base + 1)
    try:
        dap.attach()
        thread, frames = dap.wait_stopped()
        top = frames[0]["id"]
        step = dap.evaluate("so.step", top)
        batch = dap.evaluate("dict(so.num_scheduled_tokens)", top)
        print(f"rank 1 stopped in {frames[0]['name']} at step {step}; tokens to compute per request: {batch}")
        dap.continue_(thread)
    finally:
        dap.close()
    run.join(120)
    if step != "3":
        fail(f"rank 1 stopped at step {step}, not 3")
    if "r" not in result:
        fail("the replay did not finish")
    print(result["r"].verdict())
    if not result["r"].ok or result["r"].difference is not None:
        fail("the replayed tokens differ from the recording")
