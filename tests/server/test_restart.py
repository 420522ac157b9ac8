"""`serve --restart-workers`: SIGKILL of rank 1 of a tp=2 server (mp and Ray) ends the request in flight with
an error naming rank 1, /health and new requests get 503 with Retry-After while a fresh set of workers
starts (same ranks, same debug ports), then the same greedy request gives tp=1's text again from a new
rank-1 process; shutdown afterwards leaves no process, state file or shared-memory segment."""
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from devharness import LLM, SamplingParams
from devharness.config import DebugConfig
from devharness.debug.state import STATE_DIR
from devharness.distributed.shm_ring import SHM_PREFIX
from tests.helpers import free_port_base
from tests.server import serve_in_thread

pytestmark = pytest.mark.timeout(600)

PROMPT = [5, 17, 99, 3, 42, 8, 120]
BODY = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}
# Long enough that the kill lands mid-stream on any machine.
LONG = {**BODY, "max_tokens": 1500, "stream": True}


@pytest.fixture(scope="module")
def reference():
    with LLM("tiny-llama", threads_per_worker=1) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        return out[0].outputs[0].token_ids


def stream_until_error(url: str, started: threading.Event, result: dict) -> None:
    """Read a long stream; keep its error event and when it came."""
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                result["error"], result["at"] = event["error"], time.monotonic()
                return
            started.set()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)   # no busier: polling the server takes CPU from the workers starting
    return True


# Debug mode (debugpy in every worker, /debug routes) with mp only: it shows the ports come back; with Ray it
# would only make every actor start slower (a runtime env of its own).
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_killed_rank_is_restarted_and_serves_the_same_text(request, backend, reference):
    if backend == "ray":
        request.getfixturevalue("ray_instance")
    base = free_port_base()
    debug = DebugConfig(enabled=True, port_base=base) if backend == "mp" else False
    shm_before = set(os.listdir("/dev/shm"))
    with serve_in_thread(tensor_parallel_size=2, distributed_executor_backend=backend, threads_per_worker=1,
                         num_kv_blocks=128, restart_workers=True, debug=debug) as (url, llm, _):
        run_id = llm.engine.config.run_id
        before = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]
        assert before["token_ids"] == reference
        old_pids = list(llm.engine.workers.worker_pids)
        groups = [getattr(llm.engine.workers, "placement_group_id", None)]

        started, result = threading.Event(), {}
        reader = threading.Thread(target=stream_until_error, args=(url, started, result), daemon=True)
        reader.start()
        assert started.wait(60), "the long request never streamed"
        os.kill(old_pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        reader.join(30)
        assert "error" in result, "the request in flight did not end with an error"
        assert result["at"] - killed_at < 10, result
        assert result["error"]["code"] == "engine_unavailable" and "rank 1 (tp 1, pp 0" in result["error"]["message"]

        # The restart has begun before the request's error was sent, and takes a process start and a load.
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503 and health.json()["reason"] == "restarting", health.text
        assert "rank 1 (tp 1, pp 0" in health.json()["error"]["message"] and int(health.headers["Retry-After"]) >= 1
        refused = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        if refused.status_code != 200:   # the restart may just have ended
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_restarting"
            assert int(refused.headers["Retry-After"]) >= 1

        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200, 300), \
            httpx.get(f"{url}/health", timeout=30).text
        new_pids = list(llm.engine.workers.worker_pids)
        groups.append(getattr(llm.engine.workers, "placement_group_id", None))
        assert not set(new_pids) & set(old_pids) and not any(alive(p) for p in old_pids), (old_pids, new_pids)
        after = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]
        assert after["token_ids"] == reference and after["text"] == before["text"]
        if debug:   # the monitor follows the new workers: same ranks, same debug ports, new pids
            workers = httpx.get(f"{url}/debug/workers", timeout=30).json()["workers"]
            assert [(w["rank"], w["pid"], w["debugpy"]["port"], w["alive"]) for w in workers] == \
                [(r, new_pids[r], base + r, True) for r in range(2)]
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert health["restarts"] == 1 and "rank 1 (tp 1, pp 0" in health["last_restart"]["cause"], health
    assert wait_until(lambda: not any(alive(p) for p in new_pids), 30), "a worker outlived shutdown"
    assert not list(STATE_DIR.glob(f"devharness-{run_id}-*"))
    if backend == "ray":   # both sets' placement groups are gone
        import ray
        assert groups[0] != groups[1] and all(ray.util.placement_group_table()[g]["state"] == "REMOVED" for g in groups)
    ours = tuple(f"{SHM_PREFIX}{pid}_" for pid in [os.getpid(), *old_pids, *new_pids])
    assert wait_until(lambda: not {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(ours)}, 10)


def test_a_crash_loop_ends_with_the_engine_dead():
    """--max-worker-restarts 1: a step completed between two deaths resets the count (the second death restarts
    too); a death of the new workers before they complete a step ends the restarts, with the cause named."""
    def kill_rank_1_and_wait(llm, url, healthy: bool) -> dict:
        pid = llm.engine.workers.worker_pids[1]
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not alive(pid), 10)
        if healthy:
            assert wait_until(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200
                              and llm.engine.workers.worker_pids[1] != pid, 120)
            return httpx.get(f"{url}/health", timeout=30).json()
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=30).json().get("reason") == "engine_dead", 120)
        return httpx.get(f"{url}/health", timeout=30).json()

    with serve_in_thread(tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
                         num_kv_blocks=64, restart_workers=True, max_worker_restarts=1) as (url, llm, _):
        assert kill_rank_1_and_wait(llm, url, healthy=True)["restarts"] == 1
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200   # a step completes
        assert kill_rank_1_and_wait(llm, url, healthy=True)["restarts"] == 2
        dead = kill_rank_1_and_wait(llm, url, healthy=False)   # no step since the last restart
        message = dead["error"]["message"]
        assert "rank 1 (tp 1, pp 0" in message and "not restarting again" in message, message
        assert "--max-worker-restarts 1" in message, message
        refused = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable", refused.text
