"""--otlp-traces-endpoint: each ended request's story goes out as OpenTelemetry spans over OTLP/HTTP (protobuf).

A local OTLP/HTTP endpoint (a small HTTP server taking POST /v1/traces) receives them; its bodies are decoded with
OpenTelemetry's own protobuf package (opentelemetry-proto's ExportTraceServiceRequest). Each request is one trace whose
spans' times are the story's: the root from arrival to the end, prefill to the first token, decode from it to the
end, a queue span for each wait (the first, and one after each preemption). Without the option nothing is imported
or sent, even with OpenTelemetry's own environment variables pointing at the endpoint."""
import http.server
import json
import os
import subprocess
import sys
import threading
from collections import defaultdict

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from devharness import LLM, SamplingParams

TOLERANCE_S = 1e-3   # nanoseconds in the spans, float seconds in the story: only the rounding differs


class Receiver:
    """A local OTLP/HTTP endpoint: every POST's path, content type and body."""

    def __init__(self):
        posts = self.posts = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.append((self.path, self.headers.get("Content-Type"), body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list:
        out = []
        for _, _, body in self.posts:
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            out += [(rs.resource, sp) for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]
        return out

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def attrs(span) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return {a.key: value(a.value) for a in span.attributes}


def near(ns: int, t: float) -> bool:
    return abs(ns / 1e9 - t) <= TOLERANCE_S


def test_each_request_is_one_trace_whose_spans_agree_with_its_story(receiver):
    # A KV cache of 8 blocks for 4 requests of 40 + 30 tokens: some are preempted and wait again; one is aborted.
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with LLM("tiny-llama", otlp_traces_endpoint=receiver.url, num_kv_blocks=8, block_size=16,
             enable_prefix_caching=False, threads_per_worker=1) as llm:
        engine = llm.engine
        ids = [engine.add_request({"prompt_token_ids": [(7 * i + 3 * j) % 240 + 5 for j in range(40)]}, params,
                                  f"r{i}") for i in range(4)]
        engine.add_request({"prompt_token_ids": [9] * 20}, params, "gone")
        engine.abort_request("gone")
        while engine.has_unfinished_requests():
            engine.step()
        stories = {rid: engine.request_story(rid) for rid in [*ids, "gone"]}
    # Shut down: every span held was sent.
    assert {(path, ctype) for path, ctype, _ in receiver.posts} == {("/v1/traces", "application/x-protobuf")}
    spans = receiver.spans()
    assert {next(a.value.string_value for a in r.attributes if a.key == "service.name") for r, _ in spans} \
        == {"devharness"}
    traces = defaultdict(list)
    for _, sp in spans:
        traces[sp.trace_id].append(sp)
    assert len(traces) == 5, "one trace per request"
    assert sum(s.num_preemptions for s in stories.values()) > 0, "the load must preempt"
    seen = set()
    for trace in traces.values():
        roots = [s for s in trace if not s.parent_span_id]
        assert len(roots) == 1 and roots[0].name == "llm_request"
        root = roots[0]
        a = attrs(root)
        rid = a["gen_ai.request.id"]
        seen.add(rid)
        story = stories[rid]
        times = {e.kind: e.time for e in story.events}
        end = times["abort" if rid == "gone" else "finish"]
        assert near(root.start_time_unix_nano, story.arrival_time) and near(root.end_time_unix_nano, end)
        assert all(s.parent_span_id == root.span_id for s in trace if s is not root)
        assert a["gen_ai.response.model"] == "tiny-llama" and a["gen_ai.usage.prompt_tokens"] == story.num_prompt_tokens
        assert a["gen_ai.usage.completion_tokens"] == story.num_output_tokens
        assert abs(a["gen_ai.latency.e2e"] - (end - story.arrival_time)) <= TOLERANCE_S
        assert a["devharness.num_preemptions"] == story.num_preemptions
        assert [e.name for e in root.events] == [e.kind for e in story.events]
        queue = sorted((s for s in trace if s.name == "queue"), key=lambda s: s.start_time_unix_nano)
        assert len(queue) == story.num_preemptions + 1
        assert near(queue[0].start_time_unix_nano, story.arrival_time)
        preempts = [e.time for e in story.events if e.kind == "preempt"]
        for q, t in zip(queue[1:], preempts):
            assert near(q.start_time_unix_nano, t)
        by_name = {s.name: s for s in trace}
        if rid == "gone":
            assert a["gen_ai.response.finish_reasons"] == ["abort"] and set(by_name) == {"llm_request", "queue"}
            assert near(queue[0].end_time_unix_nano, end)
            continue
        first = times["first-token"]
        admit = next(e.time for e in story.events if e.kind == "admit")   # the first admission
        assert near(queue[0].end_time_unix_nano, admit)
        assert abs(a["gen_ai.latency.time_in_queue"] - (admit - story.arrival_time)) <= TOLERANCE_S
        assert abs(a["gen_ai.latency.time_to_first_token"] - (first - story.arrival_time)) <= TOLERANCE_S
        prefill, decode = by_name["prefill"], by_name["decode"]
        assert near(prefill.start_time_unix_nano, admit) and near(prefill.end_time_unix_nano, first)
        assert near(decode.start_time_unix_nano, first) and near(decode.end_time_unix_nano, end)
        assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert seen == {*ids, "gone"}


NO_FLAG = """
import json, sys
from devharness import LLM, SamplingParams
with LLM("tiny-llama", threads_per_worker=1) as llm:
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, SamplingParams(max_tokens=3))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))))
"""


def test_without_the_option_nothing_is_imported_nor_sent(receiver):
    # OpenTelemetry's own variables point at the endpoint: an SDK set up behind the user's back would send there.
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces", "OTEL_TRACES_EXPORTER": "otlp"}
    res = subprocess.run([sys.executable, "-c", NO_FLAG], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == []
    assert receiver.posts == []


@pytest.mark.parametrize("kw, words", [
    ({"otlp_traces_endpoint": "ftp://127.0.0.1/v1/traces"}, "must be an http:// or https:// URL"),
    ({"otlp_traces_endpoint": "http://127.0.0.1:4318/v1/traces?x=1"}, "otlp_traces_endpoint"),
    ({"otlp_traces_endpoint": "http://127.0.0.1:4318", "request_stories": False}, "request_stories on"),
])
def test_bad_endpoints_are_value_errors(kw, words):
    with pytest.raises(ValueError, match=words.replace("/", ".").replace("?", ".")):
        LLM("tiny-llama", **kw)


@pytest.mark.server
def test_serve_sends_a_served_requests_trace_and_flushes_at_shutdown(receiver):
    """`devharness serve --otlp-traces-endpoint URL` as a user runs it: a completion, then SIGTERM; the request's
    trace arrives, the last spans sent by the shutdown."""
    import signal

    import httpx

    from tests.helpers import serve_process
    proc, lines, url = serve_process("--otlp-traces-endpoint", receiver.url, "--threads-per-worker", "1")
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True,
                                                      "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    [root] = [sp for _, sp in receiver.spans() if sp.name == "llm_request"]
    a = attrs(root)
    assert a["gen_ai.usage.completion_tokens"] == 5 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert {sp.name for _, sp in receiver.spans() if sp.trace_id == root.trace_id} == \
        {"llm_request", "queue", "prefill", "decode"}
