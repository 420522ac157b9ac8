"""A paused rank is visible and can be let go without an IDE: /health is 503 naming the rank and where it
is paused (breakpoint or post-mortem), POST /debug/release continues it with unchanged tokens, and
SIGTERM with a rank paused, or with one hung in a collective, ends `devharness serve` within 10 s leaving no
process, file or listening port behind."""
import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from devharness import LLM, SamplingParams
from devharness.debug.state import STATE_DIR
from devharness.protocol.messages import ArmRequestFault
from tests.executor.test_loopback import assert_listens_on_loopback_only
from tests.helpers import free_port_base, serve_process, stop_process, wait_until

PROMPT = [5, 17, 99, 3, 42, 8, 120]
BODY = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}


@pytest.fixture(scope="module")
def reference():
    with LLM("tiny-llama", threads_per_worker=1) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        return out[0].outputs[0].token_ids


def in_thread(fn, *args, **kwargs):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, result


def wait_unhealthy(url, timeout_s=60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/health", timeout=30)
        if r.status_code == 503:
            return r.json()
        time.sleep(0.1)
    raise AssertionError(f"/health never said 503: {r.text}; {httpx.get(f'{url}/debug/workers', timeout=30).text}")


def test_health_names_the_paused_rank_and_release_lets_it_go_on(release_server, reference):
    url, _ = release_server
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    assert httpx.post(f"{url}/debug/break", json={"rank": 1}, timeout=30).json()["armed"] == [1]
    t, result = in_thread(httpx.post, f"{url}/v1/completions", json=BODY, timeout=120)
    health = wait_unhealthy(url)
    assert health["reason"] == health["error"]["code"] == "rank_paused"
    (paused,) = health["paused"]
    assert paused["rank"] == 1 and paused["reason"] == "breakpoint" and not paused["debugger_attached"]
    assert paused["file"].endswith(".py") and paused["line"] > 0
    assert f"rank 1 is paused (breakpoint) at {paused['file']}:{paused['line']}" in health["error"]["message"]
    time.sleep(0.5)
    assert "r" not in result   # still held
    assert httpx.post(f"{url}/debug/release", json={"rank": 0}, timeout=30).json()["released"] == []  # not paused
    assert httpx.post(f"{url}/debug/release", timeout=30).json() == {"released": [1], "attached": []}
    t.join(60)
    r = result["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.post(f"{url}/debug/release", json={"rank": 7}, timeout=30).status_code == 404


def test_post_mortem_on_one_request_then_the_engine_goes_on(release_server, reference):
    url, llm = release_server
    assert all(llm.engine.workers.control(ArmRequestFault("cmpl-pm-victim", "sample")))
    t, result = in_thread(httpx.post, f"{url}/v1/completions", json=BODY, headers={"X-Request-Id": "pm-victim"},
                          timeout=120)
    health = wait_unhealthy(url)
    (paused,) = health["paused"]
    assert paused["rank"] == 0 and paused["reason"] == "exception"   # the output rank samples
    assert httpx.post(f"{url}/debug/release", json={"rank": 0}, timeout=30).json()["released"] == [0]
    t.join(60)
    r = result["r"]
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", r.text
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    again = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == reference


def test_health_says_paused_by_a_user(release_server):
    url, _ = release_server
    httpx.post(f"{url}/debug/engine/pause", timeout=30)
    try:
        r = httpx.get(f"{url}/health", timeout=30)
        assert r.status_code == 503 and r.json()["reason"] == "engine_paused", r.text
    finally:
        httpx.post(f"{url}/debug/engine/resume", timeout=30)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def _health_when(url, ok, timeout_s, what) -> dict:
    return wait_until(lambda: h if ok(h := httpx.get(f"{url}/health", timeout=30).json()) else None, timeout_s, what)


def test_health_says_a_step_is_overdue_while_a_rank_hangs(release_server, reference):
    """A stopped rank (SIGSTOP: it publishes nothing, its peer waits in a collective): once the hang detector names
    it (hang_after_s, 1 s here), /health is 503 step_overdue naming the step and the rank; past the step timeout it
    says so too. After SIGCONT the text is unchanged, and the hang is gone from /health and /debug/workers."""
    url, _ = release_server
    pid = httpx.get(f"{url}/debug/workers", timeout=30).json()["workers"][1]["pid"]
    stop_process(pid)
    try:
        t, result = in_thread(httpx.post, f"{url}/v1/completions", json=BODY, timeout=120)
        try:
            health = wait_unhealthy(url, timeout_s=60)
            health = _health_when(url, lambda h: h.get("overdue", {}).get("ranks"), 30, "the rank holding it up")
        except AssertionError as e:
            raise AssertionError(f"{e}; request: {result}; {url}") from None
        assert health["reason"] == "step_overdue", health
        overdue = health["overdue"]
        assert overdue["ranks"] == [{"rank": 1, "why": "stopped (SIGSTOP, process state T)"}], health
        assert overdue["step"] == health["step"] and f"hang in step {overdue['step']}: rank 1 (tp 1, pp 0) is " \
            "stopped (SIGSTOP, process state T); rank(s) 0 wait for it" in health["error"]["message"], health
        snap = httpx.get(f"{url}/debug/workers", timeout=30).json()
        assert snap["engine"]["hang"] == overdue["hang"] and snap["workers"][1]["phase"] == "stopped", snap
        health = _health_when(url, lambda h: "past the step timeout of 3 s" in h["error"]["message"], 30,
                              "the step timeout")
        assert health["reason"] == "step_overdue" and health["running_s"] >= 3.0, health
        assert health["overdue"]["ranks"][0]["rank"] == 1, health
    finally:
        os.kill(pid, signal.SIGCONT)
    t.join(60)
    assert result["r"].json()["choices"][0]["token_ids"] == reference
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    wait_until(lambda: httpx.get(f"{url}/debug/workers", timeout=30).json()["engine"]["hang"] is None, 10,
               "the hang to be cleared from /debug/workers")


def test_health_names_the_dead_rank(release_server):
    """Last of the tests on this server: it kills one of its workers, stopped first in a step (a hang the detector
    names); the death ends the hang, and /debug/workers no longer shows it."""
    url, llm = release_server
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    pid = psutil.Process(llm.engine.core.executor.worker_pids[1])
    stop_process(pid.pid)
    in_thread(httpx.post, f"{url}/v1/completions", json=BODY, timeout=120)
    wait_until(lambda: httpx.get(f"{url}/debug/workers", timeout=30).json()["engine"]["hang"], 30, "the hang")
    pid.kill()
    pid.wait(30)
    health = _health_when(url, lambda h: h.get("reason") == "engine_dead", 30, "engine_dead")   # Ray: about 1 s
    assert "rank 1 (tp 1, pp 0" in health["error"]["message"], health
    assert httpx.get(f"{url}/debug/workers", timeout=30).json()["engine"]["hang"] is None   # none left over


def _serve(backend: str, *extra: str, layout: tuple[str, ...] = ("--tp", "2")
           ) -> tuple[subprocess.Popen, list[str], str]:
    """`devharness serve LAYOUT --debug` (tp=2 unless told) in its own session; (process, its output lines, its
    URL)."""
    return serve_process(*layout, "--executor", backend, "--debug", "--debug-port-base", str(free_port_base()),
                         *extra)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _sigterm_leaves_nothing(proc: subprocess.Popen, lines: list[str], url: str, stuck) -> None:
    """`stuck(url, workers)` gets a rank stuck; then SIGTERM must end the server within 10 s, leaving no
    worker or Ray process, no state or shared-memory file of its own and no listening port."""
    workers = httpx.get(f"{url}/debug/workers", timeout=30).json()["workers"]
    pids = [w["pid"] for w in workers]
    ports = [int(url.rsplit(":", 1)[1])] + [w["debugpy"]["port"] for w in workers]
    assert all(_listening(p) for p in ports), ports
    procs = psutil.Process(proc.pid).children(recursive=True)
    procs += [psutil.Process(pid) for pid in pids if pid not in {c.pid for c in procs}]   # Ray actors elsewhere
    stuck(url, workers)
    files = _own_files([proc.pid, *pids])
    assert any(p.name.startswith("devharness-") for p in files), files   # state files (shm rings on mp)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        dump = subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
        raise AssertionError(f"SIGTERM: still running after 30 s:\n{''.join(lines)[-3000:]}\n{dump.stdout}") from None
    took = time.monotonic() - t0
    assert took < 10, f"SIGTERM took {took:.1f} s:\n{''.join(lines)[-3000:]}"
    left = psutil.wait_procs(procs, timeout=5)[1]
    assert not left, f"left running: {[(p.pid, p.name()) for p in left]}"
    assert not [p for p in files if p.exists()], "state or shared-memory files left behind"
    assert not [p for p in ports if _listening(p)], f"still listening: {ports}"


def _own_files(pids: list[int]) -> set[Path]:
    """The state, log and shared-memory files of the run these processes belong to: those they have open
    or mapped, and every file of the same run id (their names say it)."""
    held = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            held |= {Path(f.path) for f in p.open_files()} | {Path(m.path) for m in p.memory_maps()}
    held = {p for p in held if p.parent == STATE_DIR and p.name.startswith("devharness")}
    run_ids = {m.group(1) for p in held if (m := re.match(r"devharness-(\w+)-rank\d+", p.name))}
    return held | {p for run_id in run_ids for p in STATE_DIR.glob(f"devharness-{run_id}-rank*")}


def test_sigterm_with_a_paused_rank_exits_within_10_s_and_leaves_nothing(release_backend):
    """mp at tp=2 x pp=2, Ray at tp=2 with the private Ray instance `serve` starts. First, while it serves, the run
    listens on loopback only (tests/executor/test_loopback.py's check, debug listeners included)."""
    def pause_rank_1(url, workers):
        httpx.post(f"{url}/debug/break", json={"rank": 1}, timeout=30)
        in_thread(httpx.post, f"{url}/v1/completions", json=BODY, timeout=120)
        assert wait_unhealthy(url)["paused"][0]["rank"] == 1

    backend = release_backend
    proc, lines, url = _serve(backend, layout=("--tp", "2", "--pp", "2") if backend == "mp" else ("--tp", "2"))
    try:
        workers = httpx.get(f"{url}/debug/workers", timeout=30).json()["workers"]
        assert len(workers) == (4 if backend == "mp" else 2), workers
        assert_listens_on_loopback_only(proc, lines, url, [w["pid"] for w in workers], own_ray=backend == "ray")
        _sigterm_leaves_nothing(proc, lines, url, pause_rank_1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_sigterm_with_a_rank_hung_in_a_collective_exits_within_10_s_and_leaves_nothing():
    """Rank 1 stalls before layer 0's all-reduce (a planted fault), so rank 0 sits in that all-reduce; then
    rank 1 is stopped outright (SIGSTOP: it answers no signal but SIGKILL). mp only: on Ray the same run
    costs a serve with its actors again, and the paused test above already ends a Ray server stuck in a step."""
    def hang_rank_1(url, workers):
        in_thread(httpx.post, f"{url}/v1/completions", json=BODY, timeout=120)
        deadline = time.monotonic() + 60
        while True:
            states = httpx.get(f"{url}/debug/workers", timeout=30).json()["workers"]
            if states[0]["detail"] == "layer 0 attention all_reduce":   # rank 1 stalls just before it
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        assert states[0]["phase"] == "collective" and states[0]["step"] == states[1]["step"] == 1, states
        os.kill(workers[1]["pid"], signal.SIGSTOP)

    proc, lines, url = _serve("mp", "--inject", "stall:step=1:rank=1:seconds=600")
    try:
        _sigterm_leaves_nothing(proc, lines, url, hang_rank_1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # the workers are in its session
            proc.wait(10)
