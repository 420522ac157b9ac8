"""Prometheus metrics for one server: a registry per app, so two apps in one process (tests) never
share counters. Per-request numbers are recorded as requests end; engine gauges and per-worker
gauges are read at scrape time."""
from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from devharness.engine.async_llm import AsyncLLM
from devharness.engine.request_story import NO_REASON, PAUSED, REASON_CODES
from devharness.diagnostics.workers import WorkerMonitor
from devharness.diagnostics import timeline

_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SKEW_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
BUBBLE_STEPS = 64   # the window of the bubble gauge: the ranks' last steps
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The server's counters, histograms and engine gauges; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self.registry = r = CollectorRegistry()
        labels = {"model_name": llm.model_name}
        self._labels = labels
        names = list(labels)
        self.requests = Counter("devharness_request_success", "Requests ended, by finish reason "
                                "(stop, length, abort = client left, error = engine failure)",
                                names + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("devharness_prompt_tokens", "Prompt tokens of ended requests",
                                     names, registry=r)
        self.generation_tokens = Counter("devharness_generation_tokens", "Tokens generated", names, registry=r)
        self.step_seconds = Histogram("devharness_engine_step_seconds", "Wall time of one engine step",
                                      names, buckets=_STEP_BUCKETS_S, registry=r)
        self.ttft_seconds = Histogram("devharness_time_to_first_token_seconds", "Arrival to first token",
                                      names, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e_seconds = Histogram("devharness_e2e_request_latency_seconds", "Arrival to last token",
                                     names, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.running = Gauge("devharness_num_requests_running", "Requests in the running batch", names, registry=r)
        self.waiting = Gauge("devharness_num_requests_waiting", "Requests waiting to be scheduled",
                             names, registry=r)
        # From the same stats as devharness_num_requests_waiting, so that its series sum to it at every scrape.
        self.waiting_by_reason = Gauge("devharness_num_requests_waiting_by_reason", "Requests waiting to be "
                                       "scheduled, by the reason the last scheduling pass gave (engine/request_story.py"
                                       "'s codes; none: no reason)", names + ["reason"], registry=r)
        self.kv_usage = Gauge("devharness_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)",
                              names, registry=r)
        self.kv_blocks_used = Gauge("devharness_kv_cache_blocks_used", "KV-cache blocks in use", names, registry=r)
        self.engine_steps = Gauge("devharness_engine_steps", "Engine steps run so far", names, registry=r)
        self.paused = Gauge("devharness_engine_paused", "1 while the engine is held between steps",
                            names, registry=r)
        self.alive = Gauge("devharness_engine_alive", "0 once the engine or a worker has died", names, registry=r)
        monitor = WorkerMonitor(llm.engine)   # only reads files here (and checks local pids)
        r.register(_WorkerCollector(monitor, labels))
        r.register(TimelineCollector(monitor, labels))
        r.register(_KvCollector(llm, labels))
        self.queue_seconds = Histogram("devharness_request_queue_time_seconds", "Time a request waited to be "
                                       "scheduled: arrival to admission, and again after each preemption",
                                       names, buckets=_LATENCY_BUCKETS_S, registry=r)
        llm.add_step_listener(self._on_step)

    def _on_step(self, seconds: float, stats: dict) -> None:
        self.step_seconds.labels(**self._labels).observe(seconds)

    def record_request(self, finish_reason: str, num_prompt_tokens: int, num_generated_tokens: int,
                       ttft_s: float | None, e2e_s: float) -> None:
        lb = self._labels
        self.requests.labels(**lb, finished_reason=finish_reason).inc()
        self.prompt_tokens.labels(**lb).inc(num_prompt_tokens)
        self.generation_tokens.labels(**lb).inc(num_generated_tokens)
        if ttft_s is not None:
            self.ttft_seconds.labels(**lb).observe(ttft_s)
        self.e2e_seconds.labels(**lb).observe(e2e_s)

    def record_queue_time(self, queued_s: float) -> None:
        """An ended request's time in the queue (RequestOutput.queued_s)."""
        self.queue_seconds.labels(**self._labels).observe(queued_s)

    def render(self) -> bytes:
        s = self.llm.stats()
        lb = self._labels
        self.running.labels(**lb).set(s.get("num_running", 0))
        self.waiting.labels(**lb).set(s.get("num_waiting", 0))
        for code, n in _waiting_by_reason(s).items():
            self.waiting_by_reason.labels(**lb, reason=code).set(n)
        total = s.get("kv_blocks_total") or 0
        used = s.get("kv_blocks_used", 0)
        self.kv_usage.labels(**lb).set(used / total if total else 0.0)
        self.kv_blocks_used.labels(**lb).set(used)
        self.engine_steps.labels(**lb).set(s.get("step", 0))
        self.paused.labels(**lb).set(1 if s.get("paused") else 0)
        self.alive.labels(**lb).set(0 if self.llm.dead_error is not None else 1)
        return generate_latest(self.registry)


def _waiting_by_reason(s: dict) -> dict[str, int]:
    counts = dict.fromkeys((*REASON_CODES, NO_REASON), 0)
    if s.get("paused"):   # the last pass's reasons are stale: the pause holds every one
        counts[PAUSED] = s.get("num_waiting", 0)
    else:
        counts.update(s.get("num_waiting_by_reason") or {NO_REASON: s.get("num_waiting", 0)})
    return counts


class _KvCollector:
    """The KV cache's counters under vLLM's names (prefix_cache_queries and prefix_cache_hits, in tokens;
    num_preemptions), from the engine's stats at scrape time: they agree with GET /debug/kv."""

    def __init__(self, llm: AsyncLLM, labels: dict[str, str]):
        self.llm, self.labels = llm, labels

    def collect(self):
        s = self.llm.stats()
        values = list(self.labels.values())
        for name, doc, key in (
                ("devharness_prefix_cache_queries", "Prefix cache queries, in tokens looked up",
                 "prefix_cache_query_tokens"),
                ("devharness_prefix_cache_hits", "Prefix cache hits, in tokens found", "prefix_cache_hit_tokens"),
                ("devharness_num_preemptions", "Requests preempted (their KV blocks taken, to compute again)",
                 "num_preemptions")):
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(values, s.get(key, 0))
            yield family


class _WorkerCollector:
    """Per-rank gauges from the states the workers publish in shared memory (every mode, not only
    --debug). Read without the workers' help, so a scrape answers while a worker is paused or hung."""

    def __init__(self, monitor: WorkerMonitor, labels: dict[str, str]):
        self.monitor, self.labels = monitor, labels

    def collect(self):
        names = [*self.labels, "rank", "tp_rank", "pp_rank"]
        step_ms = GaugeMetricFamily("devharness_worker_last_step_ms",
                                    "Wall time of the worker's last finished step, ms", labels=names)
        alive = GaugeMetricFamily("devharness_worker_alive", "1 while the worker process is alive", labels=names)
        for rank in range(self.monitor.world_size):
            st = self.monitor.worker_state(rank)
            values = [*self.labels.values(), str(st.rank), str(st.tp_rank), str(st.pp_rank)]
            alive.add_metric(values, 1.0 if st.alive else 0.0)
            if st.last_step_ms is not None:   # no sample before the worker's first step
                step_ms.add_metric(values, st.last_step_ms)
        return [step_ms, alive]


class TimelineCollector:
    """Where the time goes, live (diagnostics/timeline.py): each pipeline stage's bubble fraction over the ranks' last
    BUBBLE_STEPS steps (a gauge by pp_rank), and the skew of every collective (its last rank's arrival less its
    first's) in a histogram by group and op. The skews are read from the ranks' ledgers at scrape time: each
    collective that every rank of its group has started is observed once, those that left the ledgers' rings
    between two scrapes are not."""

    def __init__(self, monitor, labels: dict[str, str]):
        self.monitor, self.labels = monitor, labels
        self.skew = Histogram("devharness_collective_skew_seconds", "Skew of each collective: its last rank's "
                              "arrival less its first rank's", [*labels, "group", "op"], buckets=_SKEW_BUCKETS_S,
                              registry=None)
        self._seen: dict[str, int] = {}   # group -> the last collective sequence number observed
        self._lock = threading.Lock()     # two scrapes at once observe each collective once

    def collect(self):
        ranks = range(self.monitor.world_size)
        ledgers, histories = timeline.align({r: self.monitor.collectives(r) for r in ranks},
                                            {r: self.monitor.history(r) for r in ranks}, self.monitor.clock_offsets_ns)
        bubble = GaugeMetricFamily("devharness_pipeline_bubble_fraction", f"Share of the last {BUBBLE_STEPS} "
                                   "steps a pipeline stage's ranks spent not computing (between steps, or waiting "
                                   "on the pipe), 0..1", labels=[*self.labels, "pp_rank"])
        window = set(timeline.window_steps(ledgers, histories, BUBBLE_STEPS))
        pp_of = {r: pp for r, (_, pp) in timeline.layout(ledgers).items()}
        for stage in timeline.stage_answers(histories, pp_of, window):
            bubble.add_metric([*self.labels.values(), str(stage["pp_rank"])], stage["bubble_fraction"])
        with self._lock:
            newest: dict[str, int] = {}
            for e in (e for led in ledgers.values() for e in led.entries):
                newest[e.group] = max(newest.get(e.group, 0), e.collective_seq)
            for group, seq in newest.items():
                if seq < self._seen.get(group, 0):   # a fresh set of workers counts from 1 again
                    self._seen[group] = 0
            for desc, op, seq, got in timeline.arrivals(ledgers, None):
                group = next(iter(got.values())).group
                if seq > self._seen.get(group, 0):
                    starts = [e.started_ns for e in got.values()]
                    self.skew.labels(*self.labels.values(), desc, op).observe((max(starts) - min(starts)) / 1e9)
                    self._seen[group] = seq
        yield bubble
        yield from self.skew.collect()
