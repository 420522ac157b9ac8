"""The timeline's answers (diagnostics/timeline.py) on ledgers and histories made here, whose skews, straggler and
stage fractions are known by construction."""
import random

import pytest

from devharness.diagnostics import timeline
from devharness.protocol.messages import Ledger, LedgerEntry, LedgerGroup, StepRecord

MS = 1_000_000   # ns
T0 = 1_700_000_000 * 10**9
SITES = [(None, "embedding all_reduce"), (0, "attention all_reduce"), (0, "mlp all_reduce"),
         (1, "attention all_reduce"), (1, "mlp all_reduce")]


def entry(seq, step, layer, site, start_ns, op="all_reduce", group="1", peer=None, p2p=0, dur_ns=MS // 10):
    return LedgerEntry(record_id=0, group=group, op=op, collective_seq=seq, p2p_seq=p2p, peer=peer, step=step,
                       layer=layer, site=site, in_shape=[1, 64], in_dtype="float32", out_shape=[1, 64],
                       out_dtype="float32", state="completed", created_ns=start_ns, started_ns=start_ns,
                       completed_ns=start_ns + dur_ns)


def tp_ledgers(steps, late=None, tp=2, noise_ms=0.3, seed=0):
    """tp ranks of one stage: per step the five SITES one ms apart, each rank arriving within +-noise_ms; `late`
    = (rank, site index, ms): that rank arrives that much later there."""
    rng = random.Random(seed)
    groups = [LedgerGroup("0", "default_pg", list(range(tp))), LedgerGroup("1", "tp0", list(range(tp)))]
    leds = {r: Ledger(rank=r, groups=groups, entries=[]) for r in range(tp)}
    seq = 0
    for step in range(1, steps + 1):
        for i, (layer, site) in enumerate(SITES):
            seq += 1
            base = T0 + (step * 100 + i * 10) * MS
            for r in range(tp):
                t = base + int(rng.uniform(-noise_ms, noise_ms) * MS)
                if late and late[0] == r and late[1] == i:
                    t += int(late[2] * MS)
                leds[r].entries.append(entry(seq, step, layer, site, t))
    return leds


def test_skew_is_the_last_arrival_less_the_first():
    groups = [LedgerGroup("1", "tp0", [0, 1, 2])]
    leds = {r: Ledger(rank=r, groups=groups, entries=[entry(1, 1, 0, "attention all_reduce", T0 + d * MS)])
            for r, d in ((0, 0), (1, 7), (2, 3))}
    hist = {r: [StepRecord(1, {"forward": 5.0}, 5.0, 1, T0 / 1e9, T0 / 1e9 + 0.005)] for r in leds}
    got = timeline.answers(leds, hist)
    assert got["collectives"] == [{"group": "tp0", "op": "all_reduce", "count": 1, "skew_ms_p50": 7.0,
                                   "skew_ms_p99": 7.0}]
    assert got["steps"] == 1


def test_a_rank_late_at_one_site_every_step_is_the_straggler():
    leds = tp_ledgers(20, late=(1, 3, 25.0))
    got = timeline.answers(leds, {})
    s = got["straggler"]
    assert (s["rank"], s["layer"], s["site"], s["group"]) == (1, 1, "attention all_reduce", "tp0"), s
    assert s["late_ms_p50"] == pytest.approx(25.0, abs=0.7) and s["last_share"] == 1.0 and s["waiting_share"] > 0.8
    skew = got["collectives"][0]
    assert skew["skew_ms_p99"] == pytest.approx(25.0, abs=0.7) and skew["skew_ms_p50"] < 0.6
    assert "straggler: rank 1, late at layer 1 attention all_reduce (tp0) by 25." in timeline.render(got)


def test_at_tp4_the_late_rank_is_found_among_three_peers():
    got = timeline.answers(tp_ledgers(12, late=(2, 1, 8.0), tp=4, seed=3), {})["straggler"]
    assert (got["rank"], got["layer"], got["site"]) == (2, 0, "attention all_reduce")
    assert got["late_ms_p50"] == pytest.approx(8.0, abs=0.7)


@pytest.mark.parametrize("seed", range(5))
def test_noise_alone_names_no_straggler(seed):
    got = timeline.answers(tp_ledgers(30, noise_ms=0.5, seed=seed), {})
    assert got["straggler"] is None
    assert "straggler: none" in timeline.render(got)


def test_a_rank_late_now_and_then_is_not_the_straggler():
    # Late by 20 ms at one site in a third of the steps: not consistently late.
    leds = tp_ledgers(30)
    for e in leds[1].entries:
        if e.site == "mlp all_reduce" and e.layer == 0 and e.step % 3 == 0:
            e.started_ns += 20 * MS
    assert timeline.answers(leds, {})["straggler"] is None


def test_lateness_within_the_noise_is_not_a_straggler():
    # Consistently last at one site, but by less than MIN_LATE_MS.
    leds = tp_ledgers(20, late=(0, 2, 0.9), noise_ms=0.05)
    assert timeline.answers(leds, {})["straggler"] is None


def test_the_window_is_the_last_steps():
    leds = tp_ledgers(20, late=(1, 3, 25.0))
    for led in leds.values():   # rank 1 is late only up to step 10
        for e in led.entries:
            if e.step > 10 and led.rank == 1 and e.layer == 1 and e.site == "attention all_reduce":
                e.started_ns -= 25 * MS
    assert timeline.answers(leds, {})["straggler"]["rank"] == 1     # 10 of 20 late, most of the waiting
    recent = timeline.answers(leds, {}, steps=8)
    assert recent["straggler"] is None and (recent["steps"], recent["first_step"]) == (8, 13)


def test_pipeline_stages_busy_and_bubble_from_the_histories():
    # Stage 0 works 6 ms of each 10 ms step slot, stage 1 works 3 ms and waits 2 ms in its receive.
    groups0 = [LedgerGroup("1", "tp0", [0]), LedgerGroup("2", "pp0", [0, 1])]
    groups1 = [LedgerGroup("1", "tp1", [1]), LedgerGroup("2", "pp0", [0, 1])]
    leds = {0: Ledger(rank=0, groups=groups0), 1: Ledger(rank=1, groups=groups1)}
    t = T0 / 1e9
    hist = {0: [StepRecord(s, {"prepare": 1.0, "forward": 5.0, "send": 1.0}, 7.0, 1, t + s * 0.01,
                           t + s * 0.01 + 0.007) for s in range(1, 11)],
            1: [StepRecord(s, {"recv": 2.0, "forward": 3.0}, 5.0, 1, t + s * 0.01 + 0.005, t + s * 0.01 + 0.01)
                for s in range(1, 11)]}
    got = timeline.answers(leds, hist)
    span = 0.1 + 0.01 - 0.01   # step 1's start to step 10's end on rank 1
    stages = {s["pp_rank"]: s for s in got["stages"]}
    assert stages[0]["busy_fraction"] == pytest.approx(0.06 / span, abs=1e-3)
    assert stages[1]["busy_fraction"] == pytest.approx(0.03 / span, abs=1e-3)
    assert stages[1]["bubble_fraction"] == pytest.approx(1 - 0.03 / span, abs=1e-3)
    assert got["step_breakdown"] == {"prepare": pytest.approx(10 / 120, abs=1e-3), "forward": pytest.approx(
        80 / 120, abs=1e-3), "send": pytest.approx(10 / 120, abs=1e-3), "recv": pytest.approx(20 / 120, abs=1e-3)}
    assert got["straggler"] is None and got["collectives"] == []


def test_nothing_to_read_answers_empty():
    got = timeline.answers({}, {})
    assert got["steps"] == 0 and got["stages"] == [] and got["straggler"] is None
    assert timeline.render(got).startswith("trace: 0 steps")


def test_a_hangs_text_names_a_straggler_that_is_not_hung():
    from devharness.diagnostics.hang import Blocker, HangEvent, straggler_note
    leds = tp_ledgers(20, late=(1, 3, 25.0))
    note = straggler_note(leds, [0])
    assert note.startswith("rank 1 is not hung but the straggler: late at layer 1 attention all_reduce (tp0) by 2"), note
    assert straggler_note(leds, [1]) == "" and straggler_note(tp_ledgers(20), [0]) == ""
    event = HangEvent(21, (1,), (Blocker(0, "in forward"),), "layer 0 attention all_reduce", 0.0, 5.0, straggler=note)
    assert event.describe().endswith(f"for rank 0 (in forward) ({note})"), event.describe()
