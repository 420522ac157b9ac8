"""--otlp-traces-endpoint: each ended request's story (engine/request_story.py) goes out as OpenTelemetry spans, over
OTLP/HTTP (protobuf), so that Jaeger, Tempo or any OTLP collector shows it beside the rest of a system's traces.

One trace per request. Its root span `llm_request` (kind SERVER, vLLM's name) runs from the request's arrival to its
end and carries vLLM's request attributes where devharness has the same figure (gen_ai.request.id,
gen_ai.latency.time_in_queue, time_to_first_token, e2e, ...) and the story's events (admit, wait, chunk, preempt,
first-token, finish or abort, each with its step) as span events. Its children: `queue` for each spell in the waiting
queue (arrival to admission, each preemption to the next admission), `prefill` (first admission to first token) and
`decode` (first token to the end).

The OpenTelemetry SDK is imported here only, and this module only when the option is given: without it nothing is
imported and nothing is sent. The spans are made on the engine's thread when a request ends (microseconds); the SDK's
BatchSpanProcessor encodes and sends them from a thread of its own, and `shutdown` sends what it still holds.
"""
from __future__ import annotations

import logging
import os
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)

# vLLM's span attribute names (vllm/tracing.py SpanAttributes), where devharness has the same figure.
REQUEST_ID = "gen_ai.request.id"
RESPONSE_MODEL = "gen_ai.response.model"
TEMPERATURE, TOP_P, MAX_TOKENS = "gen_ai.request.temperature", "gen_ai.request.top_p", "gen_ai.request.max_tokens"
PROMPT_TOKENS, COMPLETION_TOKENS = "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens"
TIME_IN_QUEUE, TIME_TO_FIRST_TOKEN, E2E = ("gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token",
                                           "gen_ai.latency.e2e")
TIME_IN_PREFILL, TIME_IN_DECODE, TIME_IN_INFERENCE = ("gen_ai.latency.time_in_model_prefill",
                                                      "gen_ai.latency.time_in_model_decode",
                                                      "gen_ai.latency.time_in_model_inference")
FINISH_REASONS = "gen_ai.response.finish_reasons"   # OpenTelemetry's GenAI conventions
EXPORT_TIMEOUT_S = 5.0   # how long one export may take: at shutdown, an unreachable collector holds it this long


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint` as given, /v1/traces (OTLP/HTTP's path) where it has no path."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/traces")
    return urlunsplit(parts)


def _ns(t: float) -> int:
    return int(t * 1e9)


class RequestTracer:
    """Sends each ended request's story as spans (see the module docstring) to `endpoint`."""

    def __init__(self, endpoint: str, model: str):
        try:
            import opentelemetry.exporter.otlp.proto.http  # noqa: F401
            import opentelemetry.sdk  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP/HTTP exporter ({e}): "
                             "python3 -m pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http") from None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        self._kind, self._status, self._error = SpanKind.SERVER, Status, StatusCode.ERROR
        self._in_context = set_span_in_context
        self.url, self.model = traces_url(endpoint), model
        # The engine's own provider, not the process's global one: two engines in one process trace apart.
        resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or "devharness"})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url,
                                                                             timeout=EXPORT_TIMEOUT_S)))
        self.tracer = self.provider.get_tracer("devharness.engine")
        logger.info("tracing: each ended request's spans go to %s (OTLP/HTTP)", self.url)

    def export(self, story) -> None:
        """StoryBook.on_end: the spans of one ended request (a request_story.Story)."""
        req, tracer = story.req, self.tracer
        arrival, end = req.arrival_time, story.ended_at
        admitted, first = story.admitted_at, story.first_token_at
        s = req.sampling
        attrs = {REQUEST_ID: req.req_id, RESPONSE_MODEL: self.model, TEMPERATURE: s.temperature, TOP_P: s.top_p,
                 MAX_TOKENS: s.max_tokens, PROMPT_TOKENS: req.num_prompt_tokens,
                 COMPLETION_TOKENS: len(req.output_token_ids), E2E: end - arrival,
                 FINISH_REASONS: [req.finish_reason or req.status.value],
                 "devharness.num_preemptions": req.num_preemptions,
                 "devharness.prefix_hit_tokens": story.prefix_hit_tokens,
                 "devharness.queued_s": story.queued_total}
        if admitted is not None:
            attrs[TIME_IN_QUEUE] = admitted - arrival
            attrs[TIME_IN_INFERENCE] = end - admitted
            if first is not None:
                attrs[TIME_IN_PREFILL] = first - admitted
        if first is not None:
            attrs[TIME_TO_FIRST_TOKEN] = first - arrival
            attrs[TIME_IN_DECODE] = end - first
        root = tracer.start_span("llm_request", kind=self._kind, attributes=attrs, start_time=_ns(arrival))
        if req.error:
            root.set_status(self._status(self._error, req.error))
        for ev in (story.arrival, *story.events):
            ev_attrs = {"step": ev.step}
            for key in ("detail", "last_step", "tokens", "blocks"):
                value = getattr(ev, key)
                if value not in (None, ""):
                    ev_attrs[key] = value
            if ev.count > 1:
                ev_attrs["count"] = ev.count
            root.add_event(ev.kind, ev_attrs, timestamp=_ns(ev.time))
        ctx = self._in_context(root)
        children = [("queue", a, b, {"devharness.requeued": i > 0}) for i, (a, b) in enumerate(story.spells)]
        if admitted is not None and first is not None:
            children += [("prefill", admitted, first, {}), ("decode", first, end, {})]
        for name, a, b, extra in children:
            tracer.start_span(name, context=ctx, attributes=extra, start_time=_ns(a)).end(end_time=_ns(b))
        root.end(end_time=_ns(end))

    def shutdown(self) -> None:
        """Send the spans still held (an unreachable collector holds this up to EXPORT_TIMEOUT_S), then stop."""
        try:
            self.provider.shutdown()
        except Exception:
            logger.exception("tracing: the spans still held could not be sent")
