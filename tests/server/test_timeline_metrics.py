"""/metrics' view of where the time goes (server/metrics.py's TimelineCollector), on ledgers and histories made
here: each stage's bubble fraction (a gauge by pp_rank) and each collective's skew (a histogram by group and op),
read back through prometheus_client's own text parser. The live server's are in tests/monitor/test_trace.py."""
import copy

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from devharness.protocol.messages import Ledger, LedgerGroup, StepRecord
from devharness.server.metrics import TimelineCollector
from tests.diagnostics.test_timeline import T0, tp_ledgers

LABELS = {"model_name": "m"}


class FakeMonitor:
    clock_offsets_ns: dict = {}   # every rank on the driver's clock

    def __init__(self, ledgers, histories):
        self.ledgers, self.histories = ledgers, histories
        self.world_size = len(ledgers)

    def collectives(self, rank):
        return self.ledgers[rank]

    def history(self, rank):
        return self.histories.get(rank, [])


def scrape(registry) -> dict[tuple, float]:
    """(sample name, its labels but model_name) -> value."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            assert s.labels.pop("model_name") == "m", s
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def skew_buckets(got, group="tp0", op="all_reduce") -> dict[str, float]:
    return {dict(k[1])["le"]: v for k, v in got.items()
            if k[0] == "devharness_collective_skew_seconds_bucket" and dict(k[1])["group"] == group
            and dict(k[1])["op"] == op}


def test_each_collectives_skew_is_observed_once():
    # 20 steps of five collectives, rank 1 40 ms late at one of them; the others within 0.6 ms.
    monitor = FakeMonitor(tp_ledgers(20, late=(1, 3, 40.0)), {})
    registry = CollectorRegistry()
    registry.register(TimelineCollector(monitor, LABELS))
    got = scrape(registry)
    buckets = skew_buckets(got)
    assert buckets["+Inf"] == 100 and buckets["0.001"] == 80 and buckets["0.025"] == 80 and buckets["0.05"] == 100
    assert got[("devharness_collective_skew_seconds_sum", (("group", "tp0"), ("op", "all_reduce")))] == \
        pytest.approx(20 * 0.040, abs=20 * 0.0015)
    assert skew_buckets(scrape(registry))["+Inf"] == 100    # nothing new: nothing observed again
    more = tp_ledgers(30, late=(1, 3, 40.0))                 # ten steps more: their 50 collectives
    monitor.ledgers = more
    assert skew_buckets(scrape(registry))["+Inf"] == 150
    monitor.ledgers = tp_ledgers(4)                          # a fresh set of workers counts from 1 again
    assert skew_buckets(scrape(registry))["+Inf"] == 170


def test_a_collective_not_every_rank_started_waits_for_the_next_scrape():
    leds = tp_ledgers(2)
    partial = copy.deepcopy(leds)
    partial[1].entries = partial[1].entries[:-1]            # rank 1 has not reached the last one yet
    monitor = FakeMonitor(partial, {})
    registry = CollectorRegistry()
    registry.register(TimelineCollector(monitor, LABELS))
    assert skew_buckets(scrape(registry))["+Inf"] == 9
    monitor.ledgers = leds
    assert skew_buckets(scrape(registry))["+Inf"] == 10


def test_each_stages_bubble_fraction_is_a_gauge_by_pp_rank():
    # Stage 0 computes 6 ms of each 10 ms step slot, stage 1 3 ms (test_timeline's pipeline): bubbles 40%, 70%.
    groups0 = [LedgerGroup("1", "tp0", [0]), LedgerGroup("2", "pp0", [0, 1])]
    groups1 = [LedgerGroup("1", "tp1", [1]), LedgerGroup("2", "pp0", [0, 1])]
    t = T0 / 1e9
    hist = {0: [StepRecord(s, {"prepare": 1.0, "forward": 5.0, "send": 1.0}, 7.0, 1, t + s * 0.01,
                           t + s * 0.01 + 0.007) for s in range(1, 11)],
            1: [StepRecord(s, {"recv": 2.0, "forward": 3.0}, 5.0, 1, t + s * 0.01 + 0.005, t + s * 0.01 + 0.01)
                for s in range(1, 11)]}
    monitor = FakeMonitor({0: Ledger(rank=0, groups=groups0), 1: Ledger(rank=1, groups=groups1)}, hist)
    registry = CollectorRegistry()
    registry.register(TimelineCollector(monitor, LABELS))
    got = scrape(registry)
    assert got[("devharness_pipeline_bubble_fraction", (("pp_rank", "0"),))] == pytest.approx(0.4, abs=1e-3)
    assert got[("devharness_pipeline_bubble_fraction", (("pp_rank", "1"),))] == pytest.approx(0.7, abs=1e-3)
    assert not skew_buckets(got)   # no collective between two ranks: no skew
