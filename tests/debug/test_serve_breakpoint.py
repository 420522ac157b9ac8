"""`serve --debug` at tp=1 runs serving's layer loop in Python on every step: a breakpoint a DAP client sets in
`DecoderLayer.forward` stops the rank on a decode-only step (no prompt tokens in it), under the model's own
layer loop, and the request completes with the text it gets with no breakpoint set."""
import inspect
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx

import devharness.model.decoder as decoder
from tests.debug.dap_client import DAPClient
from tests.helpers import free_port_base, wait_until

MODEL = "tiny-llama"
REQUEST = {"model": MODEL, "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
# The breakpoint fires only in a step with no prompt tokens: every row a decode row.
DECODE_ONLY = "not meta.prefills and meta.num_decode_tokens == hidden.shape[0]"


class ConditionalDAPClient(DAPClient):
    """DAPClient whose breakpoints may carry a condition: a line, or (line, condition)."""

    def set_breakpoints(self, path, lines):
        bps = [{"line": n} if isinstance(n, int) else {"line": n[0], "condition": n[1]} for n in lines]
        body = self.request("setBreakpoints", {"source": {"path": path}, "breakpoints": bps})
        return body["breakpoints"]


def layer_forward_line() -> int:
    """The first line of DecoderLayer.forward's body."""
    source, first = inspect.getsourcelines(decoder.DecoderLayer.forward)
    return first + next(i for i, text in enumerate(source) if "if residual is None" in text)


def layer_loop_line() -> int:
    """The line of DecoderForCausalLM.forward that calls each layer."""
    source, first = inspect.getsourcelines(decoder.DecoderForCausalLM.forward)
    return first + next(i for i, text in enumerate(source) if "= layer(" in text)


def start_server(tmp_path: Path, port_base: int):
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # Output to a file, not a pipe: debugpy's adapter inherits it and may outlive the server for a moment.
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "devharness.cli", "serve", "--debug", "--model", MODEL,
                                 "--port", "0", "--debug-port-base", str(port_base)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=Path(__file__).resolve().parents[2])

    def url():
        assert proc.poll() is None, f"serve exited early ({proc.returncode}):\n{log.read_text()[-4000:]}"
        m = re.search(r"serving \S+ at (http://\S+)", log.read_text())
        return m and m.group(1)
    try:
        return proc, wait_until(url, 180, "serve's banner"), log
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(60)


def complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=REQUEST, timeout=600)


def test_breakpoint_in_the_decoder_layer_stops_serve_debug_on_a_decode_only_step(tmp_path):
    base = free_port_base(1)
    proc, url, log = start_server(tmp_path, base)
    client = None
    try:
        health = httpx.get(url + "/health", timeout=60)
        assert health.status_code == 200, health.text
        text = log.read_text()
        assert f"rank 0: debugpy on 127.0.0.1:{base}" in text, text

        line = layer_forward_line()
        client = ConditionalDAPClient("127.0.0.1", base, timeout_s=120)
        client.attach({decoder.__file__: [(line, DECODE_ONLY)]})

        result = {}

        def run():
            try:
                result["response"] = complete(url)
            except BaseException as e:   # noqa: BLE001 - handed to the test
                result["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        stopped = client.wait_stopped(timeout_s=300)
        assert stopped["reason"] == "breakpoint", stopped
        frames = client.stack_trace(stopped["threadId"])
        top = frames[0]
        assert (top["source"]["path"], top["line"], top["name"]) == (decoder.__file__, line, "forward")
        ev = lambda expr: client.evaluate(expr, top["id"])   # noqa: E731
        # The rank is the worker in the server's own process (uni at tp=1), and the step holds decode rows only.
        assert ev("__import__('os').getpid()") == str(proc.pid)
        assert ev("len(meta.prefills)") == "0"
        assert ev("meta.num_decode_tokens == hidden.shape[0] == 1") == "True"
        assert ev("__import__('devharness.debug.state', fromlist=['_']).current_recorder().state.step") != "1"
        # It runs serving's kernels, called from the model's Python layer loop (no C copy of the layers).
        assert ev("self.mlp.ops.backend") == "'fast'"
        assert any(f.get("source", {}).get("path") == decoder.__file__ and f["line"] == layer_loop_line()
                   for f in frames[1:]), [(f["name"], f.get("source", {}).get("path"), f["line"]) for f in frames]
        assert t.is_alive() and not result

        client.set_breakpoints(decoder.__file__, [])
        client.continue_(stopped["threadId"])
        t.join(300)
        assert not t.is_alive(), "the request did not complete after continue"
        assert "error" not in result, result.get("error")
        r = result["response"]
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == REQUEST["max_tokens"]
        client.disconnect()
        client = None

        # The same request with no breakpoint and no debugger attached: the same text.
        again = complete(url)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == body["choices"][0]["text"]
    finally:
        if client is not None:
            client.disconnect()
        stop_server(proc)
