"""`devharness trace` and GET /debug/timeline on real runs: a planted slow rank (`--inject slow`) is named as the
straggler with its layer, its median lateness within 25% of what was planted, at tp=2 (a live `serve --debug`
server, and its bundle) and at tp=2 x pp=2; a clean run names none. At pp=2 one batch in flight leaves each stage a
third idle or more, and under a steady load two batches in flight have the stages compute at once; with a uniformly
slow model (`--inject slow:ms=N`, every rank) two batches in flight cut each stage's bubble and tokens/s rises as the
stages' busy fraction does, and no straggler is named (nor at tp=2). The trace file is
held to the Trace Event Format's fields by this module's own reader (check_tef), independent of the writer."""
import json
import math
import statistics
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import msgspec
import pytest

from devharness import LLM, SamplingParams
from devharness.cli import main
from devharness.config import DebugConfig
from devharness.debug.state import StateReader
from devharness.diagnostics import timeline
from devharness.model.builtin import TINY_ARCH, write_hf_checkpoint
from devharness.monitor import trace
from tests.helpers import free_port_base
from tests.monitor.test_collectives import ledgers_of
from tests.server import serve_in_thread

# Planted lateness: large beside what a busy 2-core machine adds (a rank descheduled around its spin came 8.6 ms
# late past a planted 30 ms under a full suite, past the 25% bound).
SLOW_MS = 60.0
STEPS = 24
PARAMS = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [7] * 20}]
METADATA = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
            "thread_sort_index": "sort_index"}


def check_tef(doc: dict) -> dict:
    """Every event of a Chrome Trace Event Format document has the fields of its `ph` with their types; times
    are in order per track; slices on one track nest or are apart; each flow has one start and one finish, each
    inside a slice of its track. Returns the events by kind."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    kinds = defaultdict(list)
    last_ts = {}
    for ev in doc["traceEvents"]:
        ph = ev["ph"]
        assert ph in ("X", "M", "s", "f", "i"), ev
        assert isinstance(ev["name"], str) and type(ev["pid"]) is int and type(ev.get("tid", 0)) is int, ev
        if ph == "M":
            key = METADATA[ev["name"]]
            assert isinstance(ev["args"][key], str if key == "name" else int), ev
        else:
            assert isinstance(ev["ts"], (int, float)) and math.isfinite(ev["ts"]) and ev["ts"] >= 0, ev
            assert isinstance(ev["cat"], str), ev
            track = (ev["pid"], ev["tid"])
            assert ev["ts"] >= last_ts.get(track, 0), f"time goes back on track {track}: {ev}"
            last_ts[track] = ev["ts"]
        if ph == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0 and isinstance(ev.get("args", {}), dict), ev
        if ph in ("s", "f"):
            assert type(ev["id"]) is int, ev
        if ph == "f":
            assert ev["bp"] == "e", ev
        if ph == "i":
            assert ev["s"] in ("t", "p", "g"), ev
        kinds[ph].append(ev)
    slices = defaultdict(list)
    for ev in kinds["X"]:
        slices[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
    for track, spans in slices.items():
        open_ = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1] <= start + 1e-3:
                open_.pop()
            assert not open_ or end <= open_[-1] + 1e-3, f"slices overlap without nesting on track {track}"
            open_.append(end)
    flows = defaultdict(dict)
    for ev in kinds["s"] + kinds["f"]:
        assert ev["ph"] not in flows[ev["id"]], f"flow {ev['id']} has two {ev['ph']} events"
        flows[ev["id"]][ev["ph"]] = ev
        assert any(a - 1e-3 <= ev["ts"] <= b + 1e-3 for a, b in slices[(ev["pid"], ev["tid"])]), \
            f"flow event outside any slice of its track: {ev}"
    for fid, ends in flows.items():
        assert set(ends) == {"s", "f"} and ends["s"]["ts"] <= ends["f"]["ts"], (fid, ends)
    return kinds


def names(doc) -> dict[int, str]:
    return {ev["pid"]: ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "process_name"}


def rank_names(doc) -> dict[int, str]:
    return {pid: name for pid, name in names(doc).items() if pid != trace.DRIVER_PID}


def histories_of(llm) -> dict:
    run_id, n = llm.engine.config.run_id, llm.engine.config.parallel.world_size
    return {r: StateReader(run_id, r).history() for r in range(n)}


def assert_named(straggler, rank, layer):
    assert straggler is not None, "no straggler named"
    assert (straggler["rank"], straggler["layer"], straggler["site"]) == (rank, layer, "attention all_reduce"), \
        straggler
    assert 0.75 * SLOW_MS <= straggler["late_ms_p50"] <= 1.25 * SLOW_MS, straggler


def driver_of(doc, kinds) -> tuple[dict[int, dict], dict[str, list[dict]]]:
    """The driver process's steps ({step: its slice}) and each request's track (its slices and instants, in time
    order, by request id); the process is named and sorted first."""
    pid = trace.DRIVER_PID
    assert names(doc)[pid] == "driver (scheduler)"
    tracks = {ev["tid"]: ev["args"]["name"] for ev in doc["traceEvents"] if ev["pid"] == pid and ev["name"] ==
              "thread_name"}
    steps = {ev["args"]["step"]: ev for ev in kinds["X"] if ev["pid"] == pid and ev["name"].startswith("step ")}
    requests = defaultdict(list)
    for ev in sorted(kinds["X"] + kinds["i"], key=lambda e: e["ts"]):
        if ev["pid"] == pid and tracks[ev["tid"]].startswith("request "):
            assert tracks[ev["tid"]] == f"request {ev['args']['request_id']}", ev
            requests[ev["args"]["request_id"]].append(ev)
    return steps, dict(requests)


def assert_driver_frames_the_ranks(doc, kinds, num_requests: int, num_tokens: int):
    """Each request's life is queued, prefill, decode, finish, in order and end to end, decoding for as long as its
    tokens took; and every rank ran each step inside the driver's span of it (sent before, output back after: one
    clock)."""
    steps, requests = driver_of(doc, kinds)
    assert len(requests) == num_requests, requests
    for rid, evs in requests.items():
        assert [ev["name"] for ev in evs] == ["queued", "prefill", "decode", "finish"], (rid, evs)
        for a, b in zip(evs, evs[1:]):
            assert b["ts"] == pytest.approx(a["ts"] + a.get("dur", 0), abs=1.0), (a, b)   # one ends as the next begins
    ran = [ev for ev in kinds["X"] if ev["cat"] == "step" and ev["pid"] != trace.DRIVER_PID]
    assert ran
    for ev in ran:
        d = steps[ev["args"]["step"]]
        assert d["ts"] - 1 <= ev["ts"] and ev["ts"] + ev["dur"] <= d["ts"] + d["dur"] + 1, (ev, d)
    decode_steps = [d for d in steps.values() if d["args"]["num_tokens"] == num_requests]
    assert len(decode_steps) >= num_tokens - 2, steps


def assert_collectives_overlap(doc, groups: dict[str, tuple[int, int]]) -> int:
    """On the trace's one clock, each all-reduce of each group (its desc -> its two ranks) is under way on both
    ranks at once: neither rank's ended before the other's began (none can finish before every rank has arrived).
    How many were checked."""
    by_seq = defaultdict(dict)
    for ev in doc["traceEvents"]:
        if ev.get("cat") == "collective" and ev["args"]["op"] == "all_reduce" and ev["args"]["group"] in groups:
            by_seq[(ev["args"]["group"], ev["args"]["seq"])][ev["pid"]] = (ev["ts"], ev["ts"] + ev["dur"])
    assert by_seq, "no all-reduce in the trace"
    for (group, seq), spans in by_seq.items():
        assert set(spans) == set(groups[group]), (group, seq, spans)
        (a0, a1), (b0, b1) = spans.values()
        assert a0 <= b1 + 0.01 and b0 <= a1 + 0.01, f"{group} all_reduce {seq} does not overlap: {spans}"
    return len(by_seq)


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """A tp=2 `serve --debug` server whose rank 1 computes SLOW_MS longer at its first layer, every step."""
    dbg = DebugConfig(enabled=True, port_base=free_port_base())
    with serve_in_thread(tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
                         num_kv_blocks=64, debug=dbg, inject=f"slow:rank=1:ms={SLOW_MS:g}",
                         bundle_dir=str(tmp_path_factory.mktemp("bundles"))) as (url, llm, app):
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2, 3],
                                                      "max_tokens": STEPS, "ignore_eos": True}, timeout=120)
        r.raise_for_status()
        yield url


def test_a_live_servers_slow_rank_is_named_in_the_trace_and_the_route(slow_server, tmp_path, capsys):
    out = tmp_path / "live.json"
    assert main(["trace", "--url", slow_server, "--steps", "16", "--out", str(out), "--json"]) == 0
    answers = json.loads(capsys.readouterr().out)
    assert answers["steps"] == 16
    assert_named(answers["straggler"], 1, 0)
    doc = json.loads(out.read_text())
    kinds = check_tef(doc)
    workers = httpx.get(f"{slow_server}/debug/workers", timeout=30).json()["workers"]
    assert rank_names(doc) == {w["rank"]: f"rank {w['rank']} (tp {w['rank']}, pp 0, {w['node_ip']})" for w in workers}
    assert all(w["node_ip"] not in ("", "?") for w in workers)
    steps = [ev for ev in kinds["X"] if ev["cat"] == "step"]
    assert {ev["pid"] for ev in steps} == {0, 1} and len(steps) == 2 * 16
    driver_steps, requests = driver_of(doc, kinds)   # from GET /debug/driver: the window's steps, its request
    assert sorted(driver_steps) == sorted(ev["args"]["step"] for ev in steps if ev["pid"] == 0)
    assert len(requests) == 1 and [ev["name"] for ev in next(iter(requests.values()))][-2:] == ["decode", "finish"]
    colls = [ev for ev in kinds["X"] if ev["cat"] == "collective"]
    assert colls and all({"group", "seq", "op", "in_shape", "out_shape"} <= set(ev["args"]) for ev in colls)
    # The route answers the same question for the live window.
    got = httpx.get(f"{slow_server}/debug/timeline", params={"steps": 16}, timeout=30).json()
    assert got["steps"] == 16 and [s["pp_rank"] for s in got["stages"]] == [0]
    assert_named(got["straggler"], 1, 0)
    assert {(c["group"], c["op"]) for c in got["collectives"]} == {("tp0", "all_reduce"), ("tp0", "all_gather")}
    assert httpx.get(f"{slow_server}/debug/timeline", params={"steps": 0}, timeout=30).status_code in (400, 422)


def test_metrics_show_the_slow_ranks_skew_and_the_stages_bubble(slow_server):
    from prometheus_client.parser import text_string_to_metric_families
    got = {}
    for family in text_string_to_metric_families(httpx.get(f"{slow_server}/metrics", timeout=30).text):
        for s in family.samples:
            got[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    # Rank 1 comes SLOW_MS late to layer 0's attention all-reduce every step: that many skews above 10 ms.
    key = lambda le: ("devharness_collective_skew_seconds_bucket", (("group", "tp0"), ("le", le), ("op", "all_reduce")))
    assert got[key("+Inf")] - got[key("0.01")] >= STEPS, got
    route = httpx.get(f"{slow_server}/debug/timeline", params={"steps": 64}, timeout=30).json()
    bubble = got[("devharness_pipeline_bubble_fraction", (("pp_rank", "0"),))]
    assert bubble == pytest.approx(route["stages"][0]["bubble_fraction"], abs=1e-3) and 0 <= bubble < 1


def test_a_bundles_trace_names_the_slow_rank_too(slow_server, tmp_path, capsys):
    bundle = httpx.post(f"{slow_server}/debug/bundle", timeout=60).json()["path"]
    out = tmp_path / "bundle.json"
    assert main(["trace", bundle, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "straggler: rank 1, late at layer 0 attention all_reduce (tp0)" in printed, printed
    doc = json.loads(out.read_text())
    kinds = check_tef(doc)
    assert_named(doc["otherData"]["answers"]["straggler"], 1, 0)
    steps, requests = driver_of(doc, kinds)   # from the bundle's driver.json
    assert len(requests) == 1 and [ev["name"] for ev in next(iter(requests.values()))][-2:] == ["decode", "finish"]
    assert set(steps) >= set(range(1, STEPS + 1))


def test_a_clean_run_names_no_straggler_and_generate_writes_its_trace(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["generate", "--prompt", "one", "--prompt", "two three four", "--tp", "2", "--executor", "mp",
                 "--threads-per-worker", "1", "--num-kv-blocks", "64", "--max-tokens", str(STEPS), "--ignore-eos",
                 "--trace", str(out)]) == 0
    err = capsys.readouterr().err
    assert "straggler: none" in err and f"trace: wrote {out}" in err, err
    doc = json.loads(out.read_text())
    check_tef(doc)
    got = doc["otherData"]["answers"]
    assert got["steps"] >= STEPS and got["straggler"] is None, got
    assert {(c["group"], c["op"]) for c in got["collectives"]} == {("tp0", "all_reduce"), ("tp0", "all_gather")}
    assert_driver_frames_the_ranks(doc, check_tef(doc), 2, STEPS)


def test_at_tp2_pp2_the_slow_rank_of_the_second_stage_is_named_and_sends_meet_receives():
    with LLM("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp",
             threads_per_worker=1, num_kv_blocks=64, inject=f"slow:rank=3:ms={SLOW_MS:g}") as llm:
        llm.generate(PROMPTS, PARAMS)
        src = trace.Source(ledgers_of(llm), histories_of(llm), {})
    doc = trace.trace_events(src)
    kinds = check_tef(doc)
    assert_named(doc["otherData"]["answers"]["straggler"], 3, 2)   # stage 1's first layer
    assert [s["pp_rank"] for s in doc["otherData"]["answers"]["stages"]] == [0, 1]
    assert rank_names(doc) == {r: f"rank {r} (tp {r % 2}, pp {r // 2}, ?)" for r in range(4)}
    # Each send of stage 0 (ranks 0, 1) flows to the receive of its stage-1 peer (ranks 2, 3).
    starts = {ev["id"]: ev["pid"] for ev in kinds["s"]}
    ends = {ev["id"]: ev["pid"] for ev in kinds["f"]}
    assert starts and {(starts[i], ends[i]) for i in starts} == {(0, 2), (1, 3)}
    sends = [ev for ev in kinds["X"] if ev["cat"] == "pipeline" and ev["args"]["op"] == "send"]
    assert len(kinds["s"]) == len(sends) > 0


# A steady load at pp=2: a Llama wide enough that a stage's forward outweighs a step's turnaround (the driver, the
# hand-offs between processes), and as many rows per batch with two in flight as with one (each batch takes half the
# requests: twice the requests), so the two cases differ only in how the stages overlap.
WIDE = msgspec.structs.replace(TINY_ARCH, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, head_dim=64)
ROWS, TOKENS = 16, 16


def forward_spans(records) -> list[tuple[float, float]]:
    """Each step's forward phase as (start, end), unix seconds: the phases run in the order recorded."""
    out = []
    for s in records:
        t = s.started_at
        for phase, ms in s.phases.items():
            if phase == "forward":
                out.append((t, t + ms / 1000))
            t += ms / 1000
    return out


def overlap_s(a, b) -> float:
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def steady_run(llm, requests: int) -> tuple[float, dict, float]:
    """tokens/s of `requests` greedy requests of TOKENS tokens; the timeline's answers over their steps; the share of
    those steps' span in which both stages ran a forward at once."""
    before = max((s.step for s in histories_of(llm)[0]), default=0)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 for j in range(8)]} for i in range(requests)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    tokens_per_s = requests * TOKENS / (time.perf_counter() - t0)
    histories = histories_of(llm)
    window = {r: [s for s in h if s.step > before] for r, h in histories.items()}
    got = timeline.answers(ledgers_of(llm), histories, max(s.step for s in histories[0]) - before)
    starts = [s.started_at for h in window.values() for s in h]
    span = max(s.ended_at for h in window.values() for s in h) - min(starts)
    return tokens_per_s, got, overlap_s(forward_spans(window[0]), forward_spans(window[1])) / span


def test_pp2_with_one_batch_in_flight_each_stage_waits_a_third_of_the_time_or_more():
    # One batch: each stage waits while the other computes (and while the driver turns the step around). (That two
    # batches in flight lower it is not held here: two stages on a shared two-core machine rarely compute at once.)
    with LLM("tiny-llama", pipeline_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64, max_concurrent_batches=1) as llm:
        llm.generate(PROMPTS, PARAMS)
        histories = histories_of(llm)
        got = timeline.answers(ledgers_of(llm), histories)
    assert [s["pp_rank"] for s in got["stages"]] == [0, 1]
    assert all(0.3 <= s["bubble_fraction"] < 1 for s in got["stages"]), got["stages"]
    assert got["step_breakdown"]["recv"] > 0 and got["collectives"] == [] and got["straggler"] is None
    # The TUI's timeline view draws the same window: each stage's busy cells are its busy fraction, counted anew.
    from devharness.tui.timeline import BUSY, draw
    text, rows = draw(histories, {0: (0, 0), 1: (0, 1)}, got, width=500, steps=10 ** 6)
    for stage in got["stages"]:
        drawn = rows[stage["pp_rank"]].count(BUSY) / 500
        assert drawn == pytest.approx(stage["busy_fraction"], abs=0.05), (stage, drawn)
    assert "bubble" in text.plain and "straggler: none" in text.plain


def test_pp2_under_a_steady_load_two_batches_in_flight_overlap_the_stages_and_one_never_does(tmp_path):
    path = write_hf_checkpoint(tmp_path / "wide", WIDE)
    kw = dict(pipeline_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1, num_kv_blocks=256)
    with LLM(str(path), max_concurrent_batches=1, **kw) as one, LLM(str(path), max_concurrent_batches=2, **kw) as two:
        one_tps, got, one_overlap = steady_run(one, ROWS)
        two_tps, got2, two_overlap = steady_run(two, 2 * ROWS)
    # One batch: a stage computes only while the other waits for it.
    assert got["steps"] >= TOKENS and one_overlap == pytest.approx(0, abs=0.01), (got, one_overlap)
    # Two batches: the second really is in flight (twice the steps, each of ROWS requests), and stage 0 computes
    # one batch while stage 1 computes the other. How much faster that runs, and how much less each stage idles, is
    # not held here: on a two-core machine that other processes keep busy, a stage's wall-clock forward stretches
    # with the CPU share it gets, which moves from one run to the next by more than the overlap wins
    # (docs/benchmarks.md, bench timeline).
    assert got2["steps"] >= 2 * TOKENS and [s["pp_rank"] for s in got2["stages"]] == [0, 1], got2
    assert two_overlap > 0.05, (two_overlap, got2["stages"])
    print(f"pp=2 steady load: 1 in flight {one_tps:.0f} tokens/s, busy {[s['busy_fraction'] for s in got['stages']]}; "
          f"2 in flight {two_tps:.0f} tokens/s, busy {[s['busy_fraction'] for s in got2['stages']]}, stages computing "
          f"at once {two_overlap:.0%} of the time")


# A uniformly slow model (`--inject slow:ms=N`, no rank): every rank's first layer computes UNIFORM_MS longer, a busy
# loop on the wall clock, so a stage's forward lasts that long whatever CPU share it gets and outweighs the step's
# turnaround: the stages' overlap, not the machine's load, decides how fast pp=2 runs.
UNIFORM_MS = 30.0


def mean_busy(got) -> float:
    return sum(s["busy_fraction"] for s in got["stages"]) / len(got["stages"])


def test_pp2_with_a_uniformly_slow_model_two_batches_in_flight_cut_the_bubble_and_throughput_follows_busy():
    kw = dict(pipeline_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1, num_kv_blocks=64,
              inject=f"slow:ms={UNIFORM_MS:g}")
    with LLM("tiny-llama", max_concurrent_batches=1, **kw) as one, \
            LLM("tiny-llama", max_concurrent_batches=2, **kw) as two:
        one_tps, got, _ = steady_run(one, 4)
        two_tps, got2, _ = steady_run(two, 2 * 4)
        forwards = {r: statistics.median(s.phases["forward"] for s in h if "forward" in s.phases)
                    for r, h in histories_of(one).items()}
    # Planted on every rank: each stage's forward is at least the planted time (a wall-clock loop), and with no
    # rank late beside its peers there is no straggler.
    assert all(ms >= UNIFORM_MS for ms in forwards.values()), forwards
    assert got["straggler"] is None and got2["straggler"] is None
    assert [s["pp_rank"] for s in got["stages"]] == [s["pp_rank"] for s in got2["stages"]] == [0, 1]
    # One batch: each stage waits while the other computes its forward: about half the time.
    assert all(s["bubble_fraction"] >= 0.3 for s in got["stages"]), got["stages"]
    # Two batches: each stage computes one while the other computes the other; its bubble falls by a clear margin.
    assert got2["steps"] >= 2 * TOKENS, got2
    for s1, s2 in zip(got["stages"], got2["stages"]):
        assert s2["bubble_fraction"] <= s1["bubble_fraction"] - 0.15, (got["stages"], got2["stages"])
    # A stage that idles half the time runs half as fast: throughput moves with the busy fraction.
    tps_ratio, busy_ratio = two_tps / one_tps, mean_busy(got2) / mean_busy(got)
    print(f"pp=2, slow:ms={UNIFORM_MS:g}: 1 in flight {one_tps:.0f} tokens/s, bubble "
          f"{[s['bubble_fraction'] for s in got['stages']]}; 2 in flight {two_tps:.0f} tokens/s, bubble "
          f"{[s['bubble_fraction'] for s in got2['stages']]}; tokens/s x{tps_ratio:.2f}, busy x{busy_ratio:.2f}")
    assert tps_ratio == pytest.approx(busy_ratio, rel=0.25), (tps_ratio, busy_ratio)


def test_at_tp2_a_uniformly_slow_model_names_no_straggler():
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64, inject=f"slow:ms={SLOW_MS:g}") as llm:
        llm.generate(PROMPTS, PARAMS)
        histories = histories_of(llm)
        got = timeline.answers(ledgers_of(llm), histories)
    # Both ranks computed the planted time longer, every step; both arrive equally late: no rank is the straggler.
    for rank, h in histories.items():
        assert statistics.median(s.phases["forward"] for s in h) >= SLOW_MS, rank
    assert got["straggler"] is None, got
    assert {(c["group"], c["op"]) for c in got["collectives"]} == {("tp0", "all_reduce"), ("tp0", "all_gather")}


class _NotDebug(BaseHTTPRequestHandler):
    def do_GET(self):   # a server without --debug: no /debug routes
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def plain_server():
    server = HTTPServer(("127.0.0.1", 0), _NotDebug)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize("args, message", [
    (["{tmp}/nope", "--out", "{tmp}/t.json"], "no such bundle directory"),
    (["{tmp}", "--out", "{tmp}/t.json"], "not a bundle with collective ledgers"),
    (["--url", "{url}", "--out", "{tmp}/t.json"], "start the server with --debug"),
    (["{tmp}", "--steps", "0", "--out", "{tmp}/t.json"], "--steps"),
    (["--out", "{tmp}/t.json"], "trace needs a BUNDLE directory or --url URL"),
    (["{tmp}"], "--out"),
    (["generate", "--prompt", "hi", "--trace", "{tmp}/no/t.json"], "--trace {tmp}/no/t.json: no such directory"),
])
def test_bad_input_is_one_line_exit_2(args, message, plain_server, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, url=plain_server) for a in args]
    argv = argv if argv[0] == "generate" else ["trace", *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(tmp=tmp_path) in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("bad, why", [
    ({"name": "x", "ph": "X", "pid": "0", "tid": 1, "ts": 0, "dur": 1, "cat": "c"}, "pid"),
    ({"name": "x", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": -1, "cat": "c"}, "dur"),
    ({"name": "x", "ph": "B", "pid": 0, "tid": 1, "ts": 0, "cat": "c"}, "ph"),
    ({"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": 3}}, "name"),
    ({"name": "x", "ph": "X", "pid": 0, "tid": 1, "ts": 5, "dur": 10, "cat": "c"}, "overlap"),
    ({"name": "x", "ph": "s", "pid": 0, "tid": 1, "ts": 1, "id": 9, "cat": "c"}, "flow"),
])
def test_the_trace_reader_can_fail(bad, why):
    good = [{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 10, "cat": "c"}]
    check_tef({"traceEvents": good})
    with pytest.raises((AssertionError, KeyError)):
        check_tef({"traceEvents": good + [bad]})


def test_ranks_clocks_are_aligned_to_the_drivers(tmp_path):
    """The engine measures each rank's clock against the driver's at start-up; the trace subtracts it. Planted: rank
    1's times 5 s ahead (a node whose clock runs ahead) with that offset measured: aligned, every all-reduce overlaps
    on both ranks and skew is what it was; without the offset none overlaps and the skew is 5 s."""
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64) as llm:
        llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        src = trace.read_engine(llm.engine)
    offsets, errors = src.driver.clock_offsets_ns, src.driver.clock_uncertainty_ns
    assert set(offsets) == {0, 1} and all(abs(offsets[r]) <= errors[r] + 2_000_000 for r in offsets), (offsets, errors)
    doc = trace.trace_events(src)
    n = assert_collectives_overlap(doc, {"tp0": (0, 1)})
    p50 = doc["otherData"]["answers"]["collectives"][0]["skew_ms_p50"]
    ahead = 5_000_000_000
    led = src.ledgers[1]
    shifted = trace.Source(
        {**src.ledgers, 1: msgspec.structs.replace(led, entries=[msgspec.structs.replace(
            e, started_ns=e.started_ns + ahead, completed_ns=e.completed_ns + ahead) for e in led.entries])},
        {**src.histories, 1: [msgspec.structs.replace(r, started_at=r.started_at + ahead / 1e9,
                                                      ended_at=r.ended_at + ahead / 1e9 if r.ended_at else None)
                              for r in src.histories[1]]},
        src.states, msgspec.structs.replace(src.driver, clock_offsets_ns={0: offsets[0], 1: offsets[1] + ahead}))
    aligned = trace.trace_events(shifted)
    assert assert_collectives_overlap(aligned, {"tp0": (0, 1)}) == n
    assert aligned["otherData"]["answers"]["collectives"][0]["skew_ms_p50"] == pytest.approx(p50, abs=0.01)
    unaligned = trace.trace_events(msgspec.structs.replace(shifted, driver=msgspec.structs.replace(
        src.driver, clock_offsets_ns={})))
    with pytest.raises(AssertionError, match="does not overlap"):
        assert_collectives_overlap(unaligned, {"tp0": (0, 1)})
    assert unaligned["otherData"]["answers"]["collectives"][0]["skew_ms_p50"] > 4000


def test_generate_merges_each_ranks_torch_profile_on_the_one_clock(tmp_path, capsys):
    """`generate --trace FILE --torch`: each rank's torch.profiler events sit under that rank, and each of its
    `devharness step N` annotations (around the whole of the worker's step) holds the rank's own step N on the
    timeline (two clocks, one axis)."""
    out = tmp_path / "torch.json"
    assert main(["generate", "--prompt", "one two", "--tp", "2", "--executor", "mp", "--threads-per-worker", "1",
                 "--num-kv-blocks", "64", "--max-tokens", "6", "--ignore-eos", "--trace", str(out), "--torch"]) == 0
    doc = json.loads(out.read_text())
    kinds = check_tef(doc)
    assert doc["otherData"]["torch_events"] > 0
    ours = {(ev["pid"], ev["args"]["step"]): ev for ev in kinds["X"] if ev["cat"] == "step"}
    marks = [ev for ev in kinds["X"] if ev["name"].startswith("devharness step ")]
    assert {ev["pid"] for ev in marks} == {0, 1} and len(marks) == len(ours), (len(marks), len(ours))
    for ev in marks:
        step = ours[(ev["pid"], int(ev["name"].rsplit(" ", 1)[1]))]
        assert ev["ts"] - 1000 <= step["ts"] and step["ts"] + step["dur"] <= ev["ts"] + ev["dur"] + 1000, (ev, step)
    tracks = {(ev["pid"], ev["args"]["name"]) for ev in doc["traceEvents"] if ev["name"] == "thread_name"}
    assert any(pid == 1 and name.startswith("torch ") for pid, name in tracks), tracks
    ops = [ev for ev in kinds["X"] if ev["pid"] == 1 and ev["tid"] >= trace.TORCH_TID and ev["name"] == "devharness::linear"]
    assert ops, "no linear op of rank 1 in the merged trace"


def test_trace_torch_dir_without_a_profile_is_one_line_exit_2(tmp_path, capsys):
    assert main(["trace", str(tmp_path), "--out", str(tmp_path / "t.json"), "--torch", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("devharness: error:"), err
    assert main(["generate", "--prompt", "x", "--torch"]) == 2
    assert "--torch merges" in capsys.readouterr().err
