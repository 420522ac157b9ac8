"""Story: "rank 1 misbehaves at step 5". Stop exactly there, look around, and let the run go on.

Arms a breakpoint for rank 1 at step 5 of a tp=2 run in debug mode. Rank 1 waits for a debugger and
its peer waits in its collective; nothing times out. The published worker states say so. Attach
VS Code ("devharness: attach rank 1" in .vscode/launch.json, with the port printed below) to step
through, then continue (with no IDE at hand, `monitor.release(1)` lets it go on); the generate
finishes with the same tokens as without debugging.
"""
import threading
import time

from devharness import LLM, SamplingParams
from devharness.config import DebugConfig
from devharness.debug.breakpoints import BreakpointSpec
from devharness.monitor.workers import WorkerMonitor

if __name__ == "__main__":
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp",
             debug=DebugConfig(enabled=True)) as llm:
        monitor = WorkerMonitor(llm.engine)
        monitor.arm_breakpoint(BreakpointSpec(rank=1, step=5))
        worker = threading.Thread(target=llm.generate, args=(["Hello"], SamplingParams(max_tokens=16)))
        worker.start()
        while monitor.worker_state(1).paused is None:
            time.sleep(0.1)
        for rank in (0, 1):
            st = monitor.worker_state(rank)
            where = f"paused at {st.paused.file}:{st.paused.line}" if st.paused else f"{st.phase} {st.detail}"
            print(f"rank {rank} step {st.step}: {where} (debugpy port {st.debugpy.port})")
        print("attach a debugger to rank 1 and continue; waiting...")
        worker.join()
        print("done")
