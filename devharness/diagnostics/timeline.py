"""Where a window of steps' time went, from every rank's collective ledger and step history: the answers that
`devharness trace` prints and `GET /debug/timeline` serves. A pure function of what the ranks published, so it
reads the same from a live server, a bundle or a test's own numbers.

- skew, per collective (group, sequence number): the last rank's arrival (its ledger entry's `started_ns`) less
  the first's; per group and op its p50 and p99 in ms.
- the straggler: the rank whose late arrivals account for most of its peers' waiting (over every collective
  where it came last, its arrival less each peer's). It is named only when it is consistently late: it caused
  at least half of all the waiting in the window, and at one site (a layer's op, its worst) it came last in at
  least 60% of the steps (and at `MIN_STEPS` steps at least: a few are no pattern), with a median lateness there (its arrival less the latest peer's) of at least
  `MIN_LATE_MS` and at least `NOISE_FACTOR` times the median lateness of the last ranks at every other site
  (the noise a busy machine adds). Else null.
- stages: per pipeline stage, the share of the window (first step's start to last step's end, over all ranks)
  its ranks spent preparing, computing, in TP collectives and sampling (busy), and the rest (the bubble:
  between steps, or in a pipeline send or receive, waiting on the other stages); the mean of the stage's TP
  ranks.
- step_breakdown: each phase's share of the ranks' step time (debug/state.py's phases).

Times are the ranks' wall clocks (unix time): ranks on one node share one clock; `align` puts ranks on other nodes on
the driver's clock, with the offsets the engine measured at start-up.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

import msgspec

from devharness.protocol.messages import Ledger, LedgerEntry, StepRecord

MIN_LATE_MS = 1.0
NOISE_FACTOR = 3.0
LAST_SHARE = 0.6        # of the steps at its site a straggler came last in
MIN_STEPS = 8           # steps at its site, at least, before a rank is called a straggler
WAIT_SHARE = 0.5        # of all the waiting in the window a straggler caused
BUSY_PHASES = ("prepare", "forward", "collective", "sample")   # send, recv: waiting on the pipe
P2P = ("send", "recv")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..1) of a non-empty list."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def layout(ledgers: dict[int, Ledger]) -> dict[int, tuple[int, int]]:
    """rank -> (tp rank, pp rank), read from the groups' names in each ledger (`tpP` holds the ranks of
    stage P; `ppT` the ranks of TP rank T, stage by stage)."""
    out = {}
    for rank, led in ledgers.items():
        tp = pp = 0
        for g in led.groups:
            if g.desc.startswith("tp") and g.desc[2:].isdigit():
                pp = int(g.desc[2:])
            elif g.desc.startswith("pp") and g.desc[2:].isdigit():
                tp = int(g.desc[2:])
        out[rank] = (tp, pp)
    return out


def window_steps(ledgers: dict[int, Ledger], histories: dict[int, list[StepRecord]],
                 steps: int | None = None) -> list[int]:
    """The last `steps` step numbers the ranks hold (all of them with None): the histories' steps, else the
    ledgers'."""
    held = {r.step for recs in histories.values() for r in recs if r.step >= 1}
    if not held:
        held = {e.step for led in ledgers.values() for e in led.entries if e.step >= 1}
    ordered = sorted(held)
    return ordered[-steps:] if steps else ordered


def arrivals(ledgers: dict[int, Ledger], in_window) -> list[tuple[str, str, int, dict[int, LedgerEntry]]]:
    """Each collective every rank of its group started in the window (every step with None): (group desc, op, seq,
    {rank: entry}), by group and sequence number."""
    members, descs = {}, {}
    for led in ledgers.values():
        for g in led.groups:
            members[g.name], descs[g.name] = sorted(g.ranks), g.desc
    by_seq: dict[tuple, dict[int, LedgerEntry]] = defaultdict(dict)
    for rank, led in ledgers.items():
        for e in led.entries:
            if e.op not in P2P and e.started_ns and (in_window is None or e.step in in_window):
                by_seq[(e.group, e.collective_seq)][rank] = e
    out = []
    for (group, seq), got in sorted(by_seq.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ranks = members.get(group, [])
        if len(ranks) > 1 and sorted(got) == ranks:
            out.append((descs.get(group, group), next(iter(got.values())).op, seq, got))
    return out


def _ms(ns: float) -> float:
    return ns / 1e6


def collective_answers(colls) -> tuple[list[dict], dict | None]:
    """Skew per group and op, and the straggler (module docstring)."""
    skews: dict[tuple[str, str], list[float]] = defaultdict(list)
    caused: dict[int, float] = defaultdict(float)
    # (rank, layer, site) -> its lateness at each occurrence, how often it came last, the waiting it caused there
    at: dict[tuple, list] = defaultdict(lambda: [[], 0, 0.0, None])
    total = 0.0
    last_lateness: dict[tuple, list[float]] = defaultdict(list)   # (layer, site) -> the last rank's lateness
    for desc, op, _seq, got in colls:
        arr = {r: e.started_ns for r, e in got.items()}
        last = max(arr, key=arr.get)
        skews[(desc, op)].append(_ms(arr[last] - min(arr.values())))
        waited = sum(_ms(arr[last] - a) for a in arr.values())
        caused[last] += waited
        total += waited
        e = got[last]
        last_lateness[(e.layer, e.site)].append(_ms(arr[last] - max(a for r, a in arr.items() if r != last)))
        for r, entry in got.items():
            cell = at[(r, entry.layer, entry.site)]
            cell[0].append(_ms(arr[r] - max(a for q, a in arr.items() if q != r)))
            cell[3] = desc
            if r == last:
                cell[1] += 1
                cell[2] += waited
    collectives = [{"group": g, "op": op, "count": len(v), "skew_ms_p50": round(percentile(v, 0.5), 3),
                    "skew_ms_p99": round(percentile(v, 0.99), 3)} for (g, op), v in sorted(skews.items())]
    straggler = None
    if caused and total > 0:
        rank = max(caused, key=caused.get)
        sites = [(k, v) for k, v in at.items() if k[0] == rank and v[1]]
        if sites and caused[rank] >= WAIT_SHARE * total:
            (_, layer, site), (lateness, n_last, waited, desc) = max(sites, key=lambda kv: kv[1][2])
            late = statistics.median(lateness)
            others = [x for k, v in last_lateness.items() if k != (layer, site) for x in v]
            noise = statistics.median(others) if others else 0.0
            if len(lateness) >= MIN_STEPS and n_last >= LAST_SHARE * len(lateness) and late >= MIN_LATE_MS \
                    and late >= NOISE_FACTOR * noise:
                straggler = {"rank": rank, "layer": layer, "site": site, "group": desc, "late_ms_p50": round(late, 3),
                             "last_share": round(n_last / len(lateness), 3),
                             "waiting_share": round(caused[rank] / total, 3)}
    return collectives, straggler


def stage_answers(histories: dict[int, list[StepRecord]], pp_of: dict[int, int], in_window) -> list[dict]:
    recs = {r: [s for s in h if s.step in in_window and s.started_at and s.ended_at] for r, h in histories.items()}
    starts = [s.started_at for h in recs.values() for s in h]
    ends = [s.ended_at for h in recs.values() for s in h]
    if not starts:
        return []
    span = max(ends) - min(starts)
    busy: dict[int, list[float]] = defaultdict(list)
    for rank, h in recs.items():
        busy[pp_of.get(rank, 0)].append(sum(sum(s.phases.get(p, 0.0) for p in BUSY_PHASES) for s in h) / 1000)
    out = []
    for pp in sorted(busy):
        frac = min(1.0, statistics.fmean(busy[pp]) / span) if span > 0 else 1.0
        out.append({"pp_rank": pp, "busy_fraction": round(frac, 3), "bubble_fraction": round(1 - frac, 3)})
    return out


def step_breakdown(histories: dict[int, list[StepRecord]], in_window) -> tuple[dict, float | None]:
    """Each phase's share of the ranks' step time, and the median step (ms) over ranks and steps."""
    sums: dict[str, float] = defaultdict(float)
    totals = []
    for h in histories.values():
        for s in h:
            if s.step in in_window:
                for phase, ms in s.phases.items():
                    sums[phase] += ms
                if s.total_ms is not None:
                    totals.append(s.total_ms)
    whole = sum(sums.values())
    fractions = {p: round(ms / whole, 3) for p, ms in sums.items()} if whole > 0 else {}
    return fractions, (round(statistics.median(totals), 3) if totals else None)


def align(ledgers: dict[int, Ledger], histories: dict[int, list[StepRecord]], offsets_ns: dict[int, int] | None) \
        -> tuple[dict[int, Ledger], dict[int, list[StepRecord]]]:
    """The ledgers and histories on the driver's clock: each rank's times less its clock's offset from the driver's
    (engine/core.py measures it at start-up). Ranks without an offset, or with 0, are kept as they are."""
    if not offsets_ns or not any(offsets_ns.values()):
        return ledgers, histories
    replace = msgspec.structs.replace
    out_l, out_h = dict(ledgers), dict(histories)
    for rank, off in offsets_ns.items():
        if not off:
            continue
        if rank in ledgers:
            led = ledgers[rank]
            out_l[rank] = replace(led, entries=[replace(e, created_ns=e.created_ns - off if e.created_ns else 0,
                                                        started_ns=e.started_ns - off if e.started_ns else 0,
                                                        completed_ns=e.completed_ns - off if e.completed_ns else 0)
                                                for e in led.entries])
        if rank in histories:
            sec = off / 1e9
            out_h[rank] = [replace(r, started_at=r.started_at - sec if r.started_at is not None else None,
                                   ended_at=r.ended_at - sec if r.ended_at is not None else None)
                           for r in histories[rank]]
    return out_l, out_h


def answers(ledgers: dict[int, Ledger], histories: dict[int, list[StepRecord]], steps: int | None = None) -> dict:
    """Where the last `steps` steps' time went (all the ranks hold, with None): see the module's docstring."""
    window = window_steps(ledgers, histories, steps)
    in_window = set(window)
    collectives, straggler = collective_answers(arrivals(ledgers, in_window))
    pp_of = {r: pp for r, (_, pp) in layout(ledgers).items()}
    fractions, step_ms = step_breakdown(histories, in_window)
    return {"steps": len(window), "first_step": window[0] if window else None,
            "last_step": window[-1] if window else None, "ranks": len(set(ledgers) | set(histories)),
            "stages": stage_answers(histories, pp_of, in_window), "collectives": collectives,
            "straggler": straggler, "step_breakdown": fractions, "step_ms_p50": step_ms}


def render(ans: dict) -> str:
    """The answers in a few lines of text."""
    out = [f"trace: {ans['steps']} steps"
           + (f" ({ans['first_step']}..{ans['last_step']})" if ans["steps"] else "") + f", {ans['ranks']} ranks"
           + (f", a step {ans['step_ms_p50']:.1f} ms (median)" if ans.get("step_ms_p50") is not None else "")]
    if ans["stages"]:
        out.append("stages: " + "; ".join(f"pp {s['pp_rank']} busy {s['busy_fraction']:.0%}, bubble "
                                          f"{s['bubble_fraction']:.0%}" for s in ans["stages"]))
    for c in ans["collectives"]:
        out.append(f"skew: {c['group']} {c['op']}: p50 {c['skew_ms_p50']:.2f} ms, p99 {c['skew_ms_p99']:.2f} ms "
                   f"({c['count']} collectives)")
    s = ans["straggler"]
    if s is None:
        out.append("straggler: none (no rank is consistently late)")
    else:
        where = f"layer {s['layer']} {s['site']}" if s["layer"] is not None else s["site"]
        out.append(f"straggler: rank {s['rank']}, late at {where} ({s['group']}) by {s['late_ms_p50']:.1f} ms "
                   f"(median; last there in {s['last_share']:.0%} of the steps), {s['waiting_share']:.0%} of its "
                   f"peers' waiting")
    if ans["step_breakdown"]:
        out.append("step time: " + ", ".join(f"{p} {f:.0%}" for p, f in ans["step_breakdown"].items()))
    return "\n".join(out) + "\n"
