"""`breakpoint()` and `devharness.debug.breakpoint(...)` written in worker code: the worker waits for
a debugger and stops in the caller's frame, only where the call names it (rank, step)."""
import json
import subprocess
import sys
import textwrap

from tests.debug.dap_client import DAPClient
from tests.helpers import free_port_base, wait_until

# Run as a script: spawned mp workers import it as their main module, so the patch reaches them.
SCRIPT = textwrap.dedent("""
    import json, sys
    import devharness.debug
    import devharness.model.decoder as decoder
    from devharness.debug.state import current_recorder

    original = decoder.GatedMLP.forward

    def patched_mlp_forward(self, x):
        st = current_recorder().state
        if st.step == 3 and current_recorder().layer == 1:
            devharness.debug.breakpoint(rank=1, step=3)      # fires on rank 1 only
            if st.rank == 0:
                breakpoint()                                # the builtin, rank 0 only
        return original(self, x)

    decoder.GatedMLP.forward = patched_mlp_forward

    if __name__ == "__main__":
        from devharness import LLM, SamplingParams
        from devharness.config import DebugConfig
        base = int(sys.argv[1])
        with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
                 num_kv_blocks=32, debug=DebugConfig(enabled=True, port_base=base)) as llm:
            out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=5, temperature=0))
        with open(sys.argv[2], "w") as f:
            json.dump(out[0].outputs[0].token_ids, f)
""")


def test_breakpoint_calls_in_worker_code_stop_in_the_callers_frame(tmp_path):
    script = tmp_path / "run_with_breakpoints.py"
    script.write_text(SCRIPT)
    base = free_port_base()
    # Output goes to a file: debugpy's adapter processes inherit stdout and outlive the script.
    result = tmp_path / "tokens.json"
    proc = subprocess.Popen([sys.executable, str(script), str(base), str(result)], cwd=tmp_path)
    clients = []
    try:
        stops = {}
        for rank in (1, 0):
            client = wait_until(lambda: _connect(base + rank), 120, f"rank {rank}'s debug port")
            clients.append(client)
            client.attach()
            stopped = client.wait_stopped(timeout_s=120)
            frame = client.stack_trace(stopped["threadId"])[0]
            stops[rank] = (frame["name"], client.evaluate("st.rank", frame["id"]),
                           client.evaluate("st.step", frame["id"]))
            client.continue_(stopped["threadId"])
        proc.wait(timeout=120)
    finally:
        for c in clients:
            c.disconnect()
        if proc.poll() is None:
            proc.kill()
    assert stops == {1: ("patched_mlp_forward", "1", "3"), 0: ("patched_mlp_forward", "0", "3")}
    assert proc.returncode == 0 and len(json.loads(result.read_text())) == 5


def _connect(port):
    try:
        return DAPClient("127.0.0.1", port, timeout_s=60)
    except OSError:
        return None
