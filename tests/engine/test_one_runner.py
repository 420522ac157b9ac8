"""A worker killed mid-step goes through the same runner code (engine/runner.py) whichever front drives the engine:
LLM.generate, which steps it on the caller's thread, and `serve` (an AsyncLLM behind the HTTP server), which steps it
on the runner's thread. Both write the same bundle, restart the workers the same way (--restart-workers) and give the
caller the same account of the failure; then the same greedy request gives the same tokens on the new workers."""
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from devharness import LLM, SamplingParams
from devharness.diagnostics.bundle import BUNDLE_JSON
from tests.server import serve_in_thread

pytestmark = pytest.mark.timeout(600)

PROMPT = [5, 17, 99, 3, 42, 8, 120]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
SETTINGS = dict(tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1, num_kv_blocks=128,
                restart_workers=True)
# What the runner tells every caller of a step that a SIGKILL of rank 1 failed.
ACCOUNT = re.compile(r"engine step \d+ failed: WorkerDied: .*rank 1 \(tp 1, pp 0, pid \d+\).*"
                     r" \(the workers are restarting; send it again shortly\)", re.S)


def kill_rank_1_when(started: threading.Event, pid: int) -> threading.Thread:
    def kill():
        if started.wait(60):
            os.kill(pid, signal.SIGKILL)
    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


def generate_front(tmp_path):
    """The failure as LLM.generate's caller sees it: the note on the error it raises."""
    with LLM("tiny-llama", bundle_dir=str(tmp_path), **SETTINGS) as llm:
        before = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
        started = threading.Event()
        real_step, calls = llm.runner.engine.step, []

        def step(*a):   # the kill lands once the long request has run a few steps
            calls.append(1)
            if len(calls) == 3:
                started.set()
            return real_step(*a)
        llm.runner.engine.step = step
        killer = kill_rank_1_when(started, llm.engine.workers.worker_pids[1])
        with pytest.raises(Exception) as err:
            llm.generate([{"prompt_token_ids": PROMPT}], LONG)
        killer.join(10)
        del llm.runner.engine.step
        told = err.value.__notes__[-1]
        after = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
        return told, before, after, len(llm.runner.restarts), llm.runner.bundles.paths, llm.runner.state_name


def serve_front(tmp_path):
    """The failure as a served request's client sees it: the error event that ends its stream."""
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with serve_in_thread(bundle_dir=str(tmp_path), **SETTINGS) as (url, llm, _):
        before = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
        started = threading.Event()
        killer = kill_rank_1_when(started, llm.engine.workers.worker_pids[1])
        told = None
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 1500, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        told = event["error"]["message"]
                        break
                    started.set()
        killer.join(10)
        deadline = time.monotonic() + 300
        while httpx.get(f"{url}/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the workers never served again"
            time.sleep(0.25)
        after = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
        return told, before, after, len(llm.runner.restarts), llm.runner.bundles.paths, llm.runner.state_name


@pytest.mark.parametrize("front", [generate_front, serve_front], ids=["generate", "serve"])
def test_a_worker_killed_mid_step_goes_through_the_one_runner(tmp_path, front):
    told, before, after, restarts, bundles, state = front(tmp_path)
    assert told is not None and ACCOUNT.fullmatch(told), told
    assert restarts == 1 and state == "running" and after == before
    [bundle] = bundles   # one bundle for the failed step, with the step's error in it
    summary = json.loads((bundle / BUNDLE_JSON).read_text())
    assert summary["reason"] == "worker error" and "rank 1 (tp 1, pp 0" in summary["error"], summary["error"]
