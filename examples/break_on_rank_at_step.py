"""Story: "rank 1 misbehaves at step 5". Stop it exactly there, look around from a debugger, continue.

A tp=2 run in debug mode (every worker a debugpy listener on port base + rank) arms a breakpoint for
rank 1, step 5, layer 1 -- what `POST /debug/break {"rank": 1, "step": 5, "layer": 1}` does on a server,
or the TUI's `b`. Rank 1 stops at the start of layer 1 in the model's layer loop and waits for a
debugger; rank 0 waits for it in layer 1's all-reduce, and its published state says so. A DAP client
(what VS Code's "devharness: attach rank 1" does) attaches, reads the stack and the hidden states,
and continues: the run ends with the tokens of a plain tp=1 run.

Exits non-zero if any of that does not happen.
"""
import sys
import threading
import time

from _dap import DAPClient

from devharness import LLM, SamplingParams
from devharness.bench.dap import free_port_bases
from devharness.config import DebugConfig
from devharness.protocol.messages import BreakpointSpec
from devharness.diagnostics.workers import WorkerMonitor

PROMPT, PARAMS = {"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def fail(why: str):
    sys.exit(f"break_on_rank_at_step: the story did not come out: {why}")


if __name__ == "__main__":   # the mp executor starts worker processes that import this file
    with LLM("tiny-llama", distributed_executor_backend="uni") as llm:
        expected = llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids

    port_base = free_port_bases(1, 2)[0]
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             debug=DebugConfig(enabled=True, port_base=port_base)) as llm:
        monitor = WorkerMonitor(llm.engine)
        monitor.arm_breakpoint(BreakpointSpec(rank=1, step=5, layer=1))
        result = {}
        run = threading.Thread(target=lambda: result.update(out=llm.generate([PROMPT], PARAMS)), daemon=True)
        run.start()
        # Rank 1 pauses; rank 0 runs on into layer 1's all-reduce and waits there for it.
        deadline = time.monotonic() + 60
        while monitor.worker_state(1).paused is None or monitor.worker_state(0).waiting_for != [1]:
            if time.monotonic() > deadline or not run.is_alive():
                monitor.release()
                fail("rank 1 never paused at step 5 with rank 0 waiting for it")
            time.sleep(0.1)
        for rank in (0, 1):
            st = monitor.worker_state(rank)
            where = f"paused at {st.paused.file}:{st.paused.line}" if st.paused else f"{st.phase}: {st.detail}"
            print(f"rank {rank} step {st.step}: {where}; waiting for {st.waiting_for or 'nobody'}")
        step = monitor.worker_state(1).step

        dap = DAPClient(port_base + 1)
        try:
            dap.attach()
            thread, frames = dap.wait_stopped()
            top = frames[0]["id"]
            print("rank 1 stopped in", frames[0]["name"], f"({frames[0]['source']['path']}:{frames[0]['line']})")
            layer, shape = dap.evaluate("idx", top), dap.evaluate("tuple(hidden.shape)", top)
            print(f"  layer {layer}, hidden states {shape}")
            dap.continue_(thread)
        finally:
            dap.close()
            monitor.release()   # had anything above failed, rank 1 would still wait for a debugger
        run.join(60)
    if (layer, step) != ("1", 5):
        fail(f"stopped at layer {layer}, step {step} instead of layer 1, step 5")
    got = result["out"][0].outputs[0].token_ids if "out" in result else None
    if got != expected:
        fail(f"tokens after continuing {got} differ from tp=1's {expected}")
    print("continued: the run finished with tp=1's tokens", got)
