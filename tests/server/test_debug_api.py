"""The /debug routes on a live tp=2 debug server: worker states, the event stream, pause / step /
resume holding requests without losing any, breakpoints armed over HTTP, stacks, logs."""
import json
import pathlib
import threading
import time

import httpx
import pytest

import devharness
from tests.debug.dap_client import release
from tests.helpers import wait_until
from tests.server import serve_in_thread

# The debug server: tests/server/conftest.py's `debug_tp2_server`; two tests start one without --debug.


def complete(url, prompt, max_tokens=8, timeout=120):
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True}, timeout=timeout)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def workers(url):
    return httpx.get(f"{url}/debug/workers", timeout=30).json()


def test_workers_snapshot_has_each_rank(debug_tp2_server):
    url, _ = debug_tp2_server
    complete(url, "hello")
    snap = workers(url)
    assert [(w["rank"], w["tp_rank"], w["pp_rank"]) for w in snap["workers"]] == [(0, 0, 0), (1, 1, 0)]
    assert snap["engine"]["state"] == "running" and snap["engine"]["step"] > 0
    w1 = snap["workers"][1]
    assert w1["alive"] and w1["phase"] == "idle" and w1["step"] == snap["engine"]["step"]
    assert w1["debugpy"]["port"] > 0 and w1["debugpy"]["host"] == "127.0.0.1"
    assert w1["last_step_ms"] > 0 and w1["kv_blocks_total"] == 128
    assert w1["source_root"] == str(pathlib.Path(devharness.__file__).resolve().parents[1])   # pathMappings
    logs = httpx.get(f"{url}/debug/workers/1/logs", timeout=30).json()
    assert logs["rank"] == 1 and any("rank 1 (tp 1, pp 0," in line and "loaded layers" in line
                                     for line in logs["lines"]), logs
    hist = httpx.get(f"{url}/debug/workers/1/history", timeout=30).json()
    assert hist["steps"] and hist["steps"][-1]["step"] == w1["step"] and "forward" in hist["steps"][-1]["phases"]


def test_collective_ledgers_over_http_agree_and_the_cli_shows_them(debug_tp2_server, capsys):
    from devharness.cli import main
    from devharness.protocol.messages import Ledger
    from tests.monitor.test_collectives import assert_ledgers_agree
    import msgspec
    url, _ = debug_tp2_server
    complete(url, "count my collectives", max_tokens=3)
    got = {r: msgspec.json.decode(httpx.get(f"{url}/debug/workers/{r}/collectives", timeout=30).content, type=Ledger)
           for r in (0, 1)}
    assert assert_ledgers_agree(got) >= 10 and [g.desc for g in got[1].groups] == ["default_pg", "tp0", "pp1"]
    last = httpx.get(f"{url}/debug/workers/0/collectives?last=2", timeout=30).json()
    assert [e["collective_seq"] for e in last["entries"]] == [got[0].count - 1, got[0].count]
    assert last["entries"][-1]["op"] == "all_gather" and last["entries"][-1]["out_shape"][0] == 2
    assert main(["collectives", "--url", url, "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("group tp0 (torch name '1', ranks [0, 1]), by collective") and "all_gather logits" in out
    assert "ranks agree" in out and "<-- first" not in out


def test_a_bundle_on_demand_over_http_and_from_the_cli(debug_tp2_server, tmp_path, capsys):
    from devharness.cli import main
    from devharness.engine.replay import replay
    url, _ = debug_tp2_server
    complete(url, "bundle me")
    assert main(["bundle", "--url", url, "--out", str(tmp_path)]) == 0
    said, fetched = capsys.readouterr().out.strip().splitlines()
    path = said.removeprefix("bundle written on the server: ")
    name = path.rsplit("/", 1)[-1]
    assert fetched == f"fetched to {tmp_path / name}" and workers(url)["engine"]["bundle"] == path
    b = tmp_path / name
    summary = json.loads((b / "bundle.json").read_text())
    assert summary["reason"] == "requested" and summary["error"] is None and summary["num_steps"] > 0
    assert json.loads((b / "rank1" / "state.json").read_text())["rank"] == 1
    assert "Thread" in (b / "rank0" / "stacks.txt").read_text()
    assert sorted(p.name for p in (b / "fr").iterdir()) == ["rank_0", "rank_1"]   # Flight Recorder's format
    assert "loaded layers" in (b / "rank1" / "log.txt").read_text()
    result = replay(b, tensor_parallel_size=1, distributed_executor_backend="uni")   # on another layout
    assert result.ok and result.num_steps == summary["num_steps"], result.verdict()
    # serve --record: what the server ran so far replays token for token.
    recorded = replay(debug_tp2_server[1].engine.config.record_dir, tensor_parallel_size=1,
                      distributed_executor_backend="uni")
    assert recorded.ok and recorded.num_steps >= summary["num_steps"], recorded.verdict()
    r = httpx.get(f"{url}/debug/bundle/../../etc", timeout=30)
    assert r.status_code == 404
    r = httpx.get(f"{url}/debug/bundle/nope", timeout=30)
    assert r.status_code == 404 and "no bundle named 'nope'" in r.json()["error"]["message"]


def test_pause_step_resume_loses_nothing(debug_tp2_server):
    url, _ = debug_tp2_server
    expected = [complete(url, f"prompt {i}") for i in range(3)]
    assert httpx.post(f"{url}/debug/engine/pause", timeout=30).json()["engine"]["state"] == "paused"
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(url, f"prompt {i}")))
               for i in range(3)]
    for t in threads:
        t.start()
    # The three requests reach the paused engine (its queue), however long that takes on this machine.
    wait_until(lambda: workers(url)["engine"]["num_waiting"] == 3, 120, "three requests waiting")
    before = workers(url)["engine"]["step"]
    time.sleep(0.5)
    assert workers(url)["engine"]["step"] == before and not results      # held between steps
    r = httpx.post(f"{url}/debug/engine/step", json={"n": 1}, timeout=60).json()
    assert r["engine"]["step"] == before + 1
    assert (r["state"], r["paused_by_step"]) == ("paused", False), r
    assert r["message"] == "ran 1 step(s); it stays paused until POST /debug/engine/resume", r
    snap = workers(url)
    assert {w["step"] for w in snap["workers"]} == {before + 1}
    # Each worker's KV count (from its own block tables) agrees with the scheduler's block manager.
    assert snap["engine"]["kv_blocks_used"] > 0
    assert {w["kv_blocks_used"] for w in snap["workers"]} == {snap["engine"]["kv_blocks_used"]}
    time.sleep(0.3)
    assert workers(url)["engine"]["step"] == before + 1
    httpx.post(f"{url}/debug/engine/resume", timeout=30)
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(3)] == expected


def test_a_step_of_a_running_engine_says_it_paused_it(debug_tp2_server):
    """POST /debug/engine/step on a running engine pauses it, runs the step and leaves it paused: the reply says
    so, and so do the engine's state and /health, until /debug/engine/resume."""
    url, _ = debug_tp2_server
    assert workers(url)["engine"]["state"] == "running"
    try:
        r = httpx.post(f"{url}/debug/engine/step", timeout=60).json()
        assert (r["state"], r["paused_by_step"], r["steps"], r["engine"]["state"]) == ("paused", True, 1, "paused"), r
        assert r["message"] == ("ran 1 step(s); it was running: this paused it, and it stays paused until "
                                "POST /debug/engine/resume"), r
        assert httpx.get(f"{url}/health", timeout=30).json()["reason"] == "engine_paused"
    finally:
        httpx.post(f"{url}/debug/engine/resume", timeout=30)
    assert workers(url)["engine"]["state"] == "running" and httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert complete(url, "still fine", max_tokens=2)


def test_stream_sends_a_snapshot_for_every_step_as_it_happens(debug_tp2_server):
    """Event-based, not a rate: with the engine paused and stepped by hand, each step shows up on the stream
    (busy, at that step, every worker at it), in order, while the connection stays open."""
    url, _ = debug_tp2_server
    events, stop = [], threading.Event()

    def listen():
        with httpx.stream("GET", f"{url}/debug/stream", timeout=30) as r:
            for line in r.iter_lines():     # a snapshot on change, and one a second regardless
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if stop.is_set():
                    return

    assert httpx.post(f"{url}/debug/engine/pause", timeout=30).json()["engine"]["state"] == "paused"
    done = threading.Event()
    threading.Thread(target=lambda: (complete(url, "a long one", max_tokens=16), done.set()), daemon=True).start()
    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        wait_until(lambda: events and events[-1]["engine"]["num_waiting"] + events[-1]["engine"]["num_running"] > 0,
                   30, "the held request on the stream")
        stepped = []
        for _ in range(4):
            step = httpx.post(f"{url}/debug/engine/step", json={"n": 1}, timeout=60).json()["engine"]["step"]
            stepped.append(step)
            wait_until(lambda: any(e["engine"]["step"] == step and e["engine"]["num_running"] > 0
                                   and {w["step"] for w in e["workers"]} == {step} for e in events),
                       30, f"step {step} on the stream")
    finally:
        httpx.post(f"{url}/debug/engine/resume", timeout=30)
        stop.set()
    assert stepped == list(range(stepped[0], stepped[0] + 4))
    assert done.wait(120)
    listener.join(30)
    steps = [e["engine"]["step"] for e in events]
    assert steps == sorted(steps) and steps[-1] >= stepped[-1]


def test_break_over_http_pauses_rank1_and_stack_reads_it(debug_tp2_server):
    url, llm = debug_tp2_server
    r = httpx.post(f"{url}/debug/break", json={"rank": 1}, timeout=30)
    assert r.status_code == 200 and r.json()["armed"] == [1]
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("text", complete(url, "stop here")), daemon=True)
    t.start()
    w1 = wait_until(lambda: (w := workers(url)["workers"][1])["paused"] and w, 60, "rank 1 paused")
    assert w1["paused"]["reason"] == "breakpoint" and w1["paused"]["file"].endswith("model_runner.py")
    wait_until(lambda: workers(url)["workers"][0]["phase"] == "collective", 30, "rank 0 in a collective")
    stacks = httpx.get(f"{url}/debug/workers/0/stack", timeout=60).json()["stacks"]
    assert "tp_all_reduce" in stacks
    release(w1["debugpy"]["port"], join=t)
    assert result["text"] == complete(url, "stop here")


@pytest.mark.parametrize("method, path, body, status, param", [
    ("post", "/debug/break", {"rank": 7}, 404, "rank"), ("post", "/debug/break", {"rank": "one"}, 400, "rank"),
    ("post", "/debug/engine/step", {"n": 0}, 400, "n"), ("get", "/debug/workers/9/stack", None, 404, "rank"),
    ("get", "/debug/workers/9/logs", None, 404, "rank"), ("get", "/debug/workers/1/logs?lines=0", None, 400, "lines"),
    ("get", "/debug/workers/1/logs?lines=many", None, 400, "lines"),
    ("get", "/debug/workers/one/logs", None, 400, "rank"), ("get", "/debug/workers/2/collectives", None, 404, "rank"),
    ("get", "/debug/workers/0/collectives?last=0", None, 400, "last"),
    ("post", "/debug/break", {"layer": 3, "colour": "red"}, 400, "colour"),
    ("post", "/debug/release", {"rank": -1}, 400, "rank"),
    # a breakpoint that could never fire: no such layer, tp rank or pp rank, or a step that already ran
    ("post", "/debug/break", {"layer": 4}, 400, "layer"), ("post", "/debug/break", {"tp_rank": 2}, 400, None),
    ("post", "/debug/break", {"pp_rank": 1}, 400, None), ("post", "/debug/break", {"step": 1}, 400, "step"),
])
def test_debug_bad_input(debug_tp2_server, method, path, body, status, param):
    """Each is refused in OpenAI's error shape, naming the field (`param`, and in the message) where one is wrong."""
    url, _ = debug_tp2_server
    r = getattr(httpx, method)(f"{url}{path}", **({"json": body} if body is not None else {}), timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["param"] == param, error
    if status == 400 and param is not None:
        assert ": :" not in error["message"] and param in error["message"], error
    assert complete(url, "still fine", max_tokens=2)


def test_no_debug_routes_without_debug():
    with serve_in_thread() as (url, llm, app):
        r = httpx.get(f"{url}/debug/workers", timeout=30)
        assert r.status_code == 404 and "error" in r.json()


def test_the_kv_map_of_a_paused_engine_agrees_with_metrics_and_the_cli(debug_tp2_server, capsys):
    """GET /debug/kv while paused with requests in flight: its counts agree with a recount from its own tables and
    with /metrics at the same moment (nothing moves while paused); `devharness kv` prints the same map."""
    from prometheus_client.parser import text_string_to_metric_families

    from devharness.cli import main
    url, _ = debug_tp2_server
    shared = "a prompt long enough to fill a block or two of the cache, " * 2
    complete(url, shared + "first")   # its full blocks are cached when the next ones come
    assert httpx.post(f"{url}/debug/engine/pause", timeout=30).json()["engine"]["state"] == "paused"
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(url, shared + f"p{i}", 24)))
               for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: workers(url)["engine"]["num_waiting"] == 3, 30, "three requests queued")
        httpx.post(f"{url}/debug/engine/step", json={"n": 2}, timeout=60)
        kv = httpx.get(f"{url}/debug/kv", timeout=30).json()
        metrics = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                   for s in fam.samples}
        again = httpx.get(f"{url}/debug/kv", timeout=30).json()
        assert main(["kv", "--url", url, "--events", "5"]) == 0
        printed = capsys.readouterr().out
    finally:
        httpx.post(f"{url}/debug/engine/resume", timeout=30)
        for t in threads:
            t.join(120)
    assert {k: v for k, v in kv.items() if k != "time"} == {k: v for k, v in again.items() if k != "time"}
    running = [r for r in kv["requests"] if r["status"] == "running"]
    assert len(running) == 3 and all(r["blocks"] for r in running)
    held = [b for r in running for b in r["blocks"]]
    assert kv["num_used"] == len(set(held)) == sum(1 for c in kv["ref_counts"] if c)
    assert all(kv["ref_counts"][b] == held.count(b) for b in set(held))
    assert all(r["prefix_hit_blocks"] > 0 for r in running)   # the shared prefix was cached
    assert any(e["kind"] == "lookup" and e["blocks"] for e in kv["events"])
    assert kv["sanitizer"] is True   # on in debug mode
    assert metrics["devharness_kv_cache_usage_perc"] == pytest.approx(kv["usage"])
    assert metrics["devharness_kv_cache_blocks_used"] == kv["num_used"]
    assert metrics["devharness_prefix_cache_queries_total"] == kv["prefix_queries"]
    assert metrics["devharness_prefix_cache_hits_total"] == kv["prefix_hits"] > 0
    assert metrics["devharness_num_preemptions_total"] == kv["preemptions"]
    assert f"KV cache at step {kv['step']}: {kv['num_blocks']} blocks of {kv['block_size']} tokens; " \
           f"{kv['num_used']} used" in printed
    assert all(f" {r['request']} " in printed for r in running)
    assert len(results) == 3


def test_kv_from_the_cli_without_debug_or_unreachable_is_one_line_exit_2(capsys):
    from devharness.cli import main
    with serve_in_thread() as (url, llm, app):
        assert main(["kv", "--url", url]) == 2
        kv_err = capsys.readouterr().err.strip().splitlines()
        assert main(["requests", "--url", url]) == 2
    assert kv_err == [f"devharness: error: {url} has no /debug/kv: start the server with --debug"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"devharness: error: {url} has no /debug/requests: start the server with --debug"]
    assert main(["kv", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("devharness: error: http://127.0.0.1:9: cannot reach the server")


def test_requests_of_a_paused_engine_wait_for_it_and_tell_their_story(debug_tp2_server, capsys):
    """GET /debug/requests while paused: every queued request waits with the `paused` reason; once resumed, each one's
    story (GET /debug/requests/{id}) runs from arrival to finish; an unknown id is a 404 in OpenAI's error shape, and
    `devharness requests` prints the same."""
    from devharness.cli import main
    url, _ = debug_tp2_server
    assert httpx.post(f"{url}/debug/engine/pause", timeout=30).json()["engine"]["state"] == "paused"
    threads = [threading.Thread(target=complete, args=(url, f"why do I wait {i}", 4)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: workers(url)["engine"]["num_waiting"] == 3, 30, "three requests queued")
        snap = httpx.get(f"{url}/debug/requests", timeout=30).json()
        assert main(["requests", "--url", url]) == 0
        printed = capsys.readouterr().out
    finally:
        httpx.post(f"{url}/debug/engine/resume", timeout=30)
        for t in threads:
            t.join(120)
    assert snap["paused"] is True and not snap["stalls"]
    waiting = [r for r in snap["requests"] if r["state"] == "waiting"]
    assert len(waiting) == 3 and all(r["waiting_reason"]["code"] == "paused" for r in waiting)
    assert all(f"{r['request_id']} " in printed and "paused:" in printed for r in waiting)
    rid = waiting[0]["request_id"]
    story = httpx.get(f"{url}/debug/requests/{rid}", timeout=30).json()
    kinds = [e["kind"] for e in story["events"]]
    assert story["state"] == "finished" and story["finish_reason"] == "length" and story["num_output_tokens"] == 4
    assert kinds[0] == "arrive" and kinds[-1] == "finish" and "admit" in kinds and "first-token" in kinds
    assert story["waiting_reason"] is None and story["queued_s"] > 0   # it waited out the pause
    assert main(["requests", "--url", url, rid, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["request_id"] == rid
    r = httpx.get(f"{url}/debug/requests/no-such-request", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found" \
        and "no-such-request" in r.json()["error"]["message"]
    assert main(["requests", "--url", url, "no-such-request"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-request" in err[0]
