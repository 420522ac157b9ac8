"""`devharness trace BUNDLE | --url URL [--steps N] --out FILE [--json]`: one timeline of every rank, as one Chrome
Trace Event Format file (Perfetto's ui.perfetto.dev and chrome://tracing open it), and where the time went
(diagnostics/timeline.py's answers, printed); `generate ... --trace FILE` writes the same around a run.

A process per rank, `rank r (tp t, pp p, node)`, with a thread (track) each for its steps (from its step history:
each step's phases in its args), its layers (each layer from the end of the op before it to the end of its last
collective: layers are seen through their collectives, so at tp=1 only a pipeline's stages show), its phases
(the ledger's ops and the compute between them), its collectives (group, sequence number, op, shapes, site) and
its pipeline sends and receives, each send joined to its receive by a flow arrow. Every time is the ranks' wall
clock (unix time, from their ledgers and histories), shown from the window's first event: ranks on one node share
one clock. Read from a bundle's rank<R>/ files or a `serve --debug` server's /debug routes; no torch here.
"""
from __future__ import annotations

import json
from pathlib import Path

import msgspec

from devharness.diagnostics import timeline
from devharness.monitor.collectives_view import read_debug_server
from devharness.protocol.json_codecs import (driver_decoder, read_history, read_ledger, step_records_decoder,
                                             worker_state_decoder)
from devharness.protocol.messages import DriverTimeline, Ledger, LedgerEntry, StepRecord, WorkerState

TRACKS = {"steps": 1, "layers": 2, "phases": 3, "collectives": 4, "pipeline": 5}
P2P = ("send", "recv")
DRIVER_PID = 1_000_000   # the driver's process, above every rank's (pid = rank)


class Source(msgspec.Struct):
    """What a trace is made of: per rank its ledger, its step history and its state (tp, pp, node), where known."""

    ledgers: dict[int, Ledger]
    histories: dict[int, list[StepRecord]]
    states: dict[int, WorkerState]
    driver: DriverTimeline | None = None   # the driver's steps and the requests' stories, where read


def read_bundle(path: str | Path) -> Source:
    """A bundle's ranks; ValueError naming what is missing or unreadable (a rank's file that says why it could not be
    read is left out)."""
    from devharness.monitor.collectives_view import read_bundle as read_ledgers
    d = Path(path)
    ledgers = read_ledgers(d)
    histories, states = {}, {}
    for rank in ledgers:
        for name, decoder, into in (("history.json", step_records_decoder, histories),
                                    ("state.json", worker_state_decoder, states)):
            f = d / f"rank{rank}" / name
            try:
                into[rank] = decoder.decode(f.read_bytes())
            except (OSError, ValueError):
                pass   # missing, or `{"error": ...}`: the ledgers still make a timeline
    try:
        driver = driver_decoder.decode((d / "driver.json").read_bytes())
    except (OSError, ValueError):
        driver = None   # a bundle from before driver.json, or `{"error": ...}`: the ranks' timeline only
    return Source(ledgers, histories, states, driver)


def read_url(url: str, token: str | None = None) -> Source:
    import httpx
    states, got = read_debug_server(url, token, {"collectives": read_ledger, "history": read_history})
    try:
        r = httpx.get(f"{url.rstrip('/')}/debug/driver", timeout=30,
                      headers={"Authorization": f"Bearer {token}"} if token else {})
        driver = driver_decoder.decode(r.content) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        driver = None   # the ranks' timeline still stands
    return Source(got["collectives"], got["history"], states, driver)


def read_engine(engine) -> Source:
    """A running engine's ranks, read from the driver as the /debug routes read them (monitor/workers.py)."""
    from devharness.diagnostics.workers import WorkerMonitor
    monitor = WorkerMonitor(engine)
    ranks = range(monitor.world_size)
    return Source({r: monitor.collectives(r) for r in ranks}, {r: monitor.history(r) for r in ranks},
                  {r: monitor.worker_state(r) for r in ranks}, engine.driver_timeline())


def write(src: Source, out: str | Path, steps: int | None = None, torch_traces: dict[int, str] | None = None) -> dict:
    """Write the trace of `src` to `out` (each rank's torch.profiler trace of `torch_traces` merged under it); the
    document. ValueError naming `out` where it cannot be written, or a torch trace that cannot be read."""
    doc = trace_events(src, steps)
    if torch_traces:
        merge_torch(doc, torch_traces)
    try:
        Path(out).write_text(json.dumps(doc, separators=(",", ":")))
    except OSError as e:
        raise ValueError(f"{out}: {e.strerror or e}") from None
    return doc


def _rank_name(rank: int, src: Source, tp_pp: dict[int, tuple[int, int]]) -> str:
    st = src.states.get(rank)
    tp, pp = (st.tp_rank, st.pp_rank) if st is not None else tp_pp.get(rank, (0, 0))
    node = st.node_ip if st is not None else "?"
    return f"rank {rank} (tp {tp}, pp {pp}, {node})"


def _op_args(e: LedgerEntry, desc: str) -> dict:
    return {"group": desc, "seq": e.seq, "op": e.op, "step": e.step, "layer": e.layer, "site": e.site,
            "in_shape": e.in_shape, "out_shape": e.out_shape, "dtype": e.in_dtype, "state": e.state,
            **({"peer": e.peer} if e.peer is not None else {})}


def trace_events(src: Source, steps: int | None = None) -> dict:
    """The Trace Event Format document of the last `steps` steps (all with None), the answers in its otherData."""
    offsets = src.driver.clock_offsets_ns if src.driver is not None else {}
    ledgers, histories = timeline.align(src.ledgers, src.histories, offsets)
    src = Source(ledgers, histories, src.states, src.driver)
    window = timeline.window_steps(src.ledgers, src.histories, steps)
    in_window = set(window)
    ranks = sorted(set(src.ledgers) | set(src.histories))
    tp_pp = timeline.layout(src.ledgers)
    descs = {g.name: g.desc for led in src.ledgers.values() for g in led.groups}
    ops = {r: [e for e in src.ledgers[r].entries if e.step in in_window and e.started_ns] if r in src.ledgers else []
           for r in ranks}
    recs = {r: [s for s in src.histories.get(r, []) if s.step in in_window and s.started_at is not None
                and s.total_ms is not None] for r in ranks}
    last_ns = max([max(e.completed_ns, e.started_ns) for es in ops.values() for e in es]
                  + [int((s.started_at + s.total_ms / 1000) * 1e9) for rs in recs.values() for s in rs], default=0)
    starts = [e.started_ns for es in ops.values() for e in es] + [int(s.started_at * 1e9)
                                                                 for rs in recs.values() for s in rs]
    drv = _driver_in_window(src.driver, in_window)
    starts += [int(d.scheduled * 1e9) for d in drv[0]] + [int(e.time * 1e9) for st in drv[1] for e in st.events
                                                          if e.time is not None]
    t0 = min(starts, default=0)
    us = lambda ns: round((ns - t0) / 1000, 3)   # noqa: E731
    meta, events = [], []

    def slice_(rank, track, name, start_ns, end_ns, cat, args):
        events.append({"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": TRACKS[track], "ts": us(start_ns),
                       "dur": round(max(0, end_ns - start_ns) / 1000, 3), "args": args})

    for rank in ranks:
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                     "args": {"name": _rank_name(rank, src, tp_pp)}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for track, tid in TRACKS.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
        for s in recs[rank]:
            start = int(s.started_at * 1e9)
            slice_(rank, "steps", f"step {s.step}", start, start + int(s.total_ms * 1e6), "step",
                   {"step": s.step, "num_tokens": s.num_tokens, "total_ms": s.total_ms, "phases_ms": s.phases})
        step_start = {s.step: int(s.started_at * 1e9) for s in recs[rank]}
        prev_end: dict[int, int] = {}   # step -> the end of the op before
        layer_span: dict[tuple[int, int], list[int]] = {}
        for e in ops[rank]:
            end = e.completed_ns or last_ns
            before = prev_end.get(e.step, step_start.get(e.step))
            if before is not None and e.started_ns > before:
                slice_(rank, "phases", "compute", before, e.started_ns, "phase", {"step": e.step})
            phase = e.op if e.op in P2P else "collective"
            slice_(rank, "phases", phase, e.started_ns, end, "phase", {"step": e.step, "site": e.where()})
            args = _op_args(e, descs.get(e.group, e.group))
            if e.op in P2P:
                name = f"{e.op} {'to' if e.op == 'send' else 'from'} rank {e.peer}"
                slice_(rank, "pipeline", name, e.started_ns, end, "pipeline", args)
            else:
                slice_(rank, "collectives", f"{e.op} {args['group']}", e.started_ns, end, "collective", args)
            if e.layer is not None:
                span = layer_span.setdefault((e.step, e.layer), [before if before is not None else e.started_ns, end])
                span[1] = end
            prev_end[e.step] = end
        for (step, layer), (start, end) in layer_span.items():
            slice_(rank, "layers", f"layer {layer}", start, end, "layer", {"step": step, "layer": layer})
    events += _flows(ops, us)
    if src.driver is not None:
        _driver_events(*drv, meta, events, us, last_ns)
    events.sort(key=lambda ev: (ev["pid"], ev["tid"], ev["ts"], -ev.get("dur", 0)))
    answers = timeline.answers(src.ledgers, src.histories, steps)
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"t0_unix_ns": t0, "clock": "the driver's wall clock (unix time): each rank's times less its "
                          "clock's offset from the driver's, measured at start-up (0 on the driver's node)",
                          "clock_offsets_ns": offsets,
                          "clock_uncertainty_ns": src.driver.clock_uncertainty_ns if src.driver is not None else {},
                          "answers": answers}}


def _driver_in_window(driver: DriverTimeline | None, in_window: set[int]):
    """The driver's steps in the window, and the stories of the requests those steps ran (or that were waiting)."""
    if driver is None:
        return [], []
    steps = [d for d in driver.steps if d.step in in_window] if in_window else list(driver.steps)
    if not steps:
        return [], []
    first, last = steps[0].scheduled, max(d.applied or d.done or d.sent for d in steps)
    ran = {rid for d in steps for rid in d.tokens}
    stories = []
    for st in driver.requests:
        times = [e.time for e in st.events if e.time is not None]
        if st.request_id in ran or (times and min(times) <= last and max(times) >= first):
            stories.append(st)
    return steps, stories


# A request's life, from its story's events: each of these opens a span that lasts to the next of them (or finish,
# abort); waits and prefill chunks fall inside.
_LIFE = {"arrive": "queued", "preempt": "queued", "admit": "prefill", "first-token": "decode"}
_ENDS = (*_LIFE, "finish", "abort")
DRIVER_STEPS_TID = 1    # the driver's steps; a second batch in flight gets the next track, and so on
FIRST_REQUEST_TID = 100


def _driver_events(steps, stories, meta: list, events: list, us, last_ns: int) -> None:
    """The driver's process: its steps (scheduled to applied, with the scheduling pass and the update inside; each
    batch in flight on a track of its own) and a track per request: queued (arrival or preemption to admission),
    prefill (admission to first token; after a preemption, `running`: it computes its tokens again and decodes) and
    decode (first token to finish), its prefill chunks, finish or abort as instants."""
    pid = DRIVER_PID
    meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "driver (scheduler)"}})
    meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": -1}})
    ns = lambda t: int(t * 1e9)   # noqa: E731

    def x(tid, name, start, end, cat, args):
        events.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": us(start),
                       "dur": round(max(0, end - start) / 1000, 3), "args": args})

    lanes: list[int] = []   # each steps track's last end
    for d in steps:
        start = ns(d.scheduled)
        end = max(ns(d.applied) if d.applied is not None else last_ns, ns(d.sent))
        lane = next((i for i, busy in enumerate(lanes) if busy <= start), len(lanes))
        if lane == len(lanes):
            lanes.append(0)
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": DRIVER_STEPS_TID + lane,
                         "args": {"name": "steps" if lane == 0 else f"steps (batch {lane + 1} in flight)"}})
        lanes[lane] = end
        tid = DRIVER_STEPS_TID + lane
        x(tid, f"step {d.step}", start, end, "driver",
          {"step": d.step, "num_tokens": sum(d.tokens.values()), "requests": d.tokens})
        x(tid, "schedule", start, ns(d.sent), "driver", {"step": d.step})
        if d.done is not None and d.applied is not None:
            x(tid, "update", ns(d.done), ns(d.applied), "driver", {"step": d.step})
    for i, st in enumerate(stories):
        tid = FIRST_REQUEST_TID + i
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": f"request {st.request_id}"}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        evs = [e for e in st.events if e.time is not None]
        decoded = False
        for j, e in enumerate(evs):
            if e.kind in _LIFE:
                nxt = next((n for n in evs[j + 1:] if n.kind in _ENDS), None)
                end = ns(nxt.time) if nxt is not None else last_ns
                name = "running" if e.kind == "admit" and decoded else _LIFE[e.kind]
                decoded = decoded or e.kind == "first-token"
                x(tid, name, ns(e.time), max(end, ns(e.time)), "request",
                  {"request_id": st.request_id, "step": e.step, "detail": e.detail,
                   **({"tokens": e.tokens} if e.tokens is not None else {})})
            elif e.kind in ("chunk", "finish", "abort"):
                events.append({"name": f"chunk of {e.tokens} tokens" if e.kind == "chunk" else e.kind,
                               "cat": "request", "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": us(ns(e.time)),
                               "args": {"request_id": st.request_id, "step": e.step, "detail": e.detail}})


TORCH_TID = 1000          # a rank's torch.profiler threads: tracks from here on, under the rank's own
TORCH_FLOW_ID = 10 ** 9   # torch's flow ids, moved past ours (rank r's: (r + 1) * TORCH_FLOW_ID + id)


def torch_traces_in(directory: str | Path) -> dict[int, str]:
    """The newest torch.profiler trace of each rank in `directory`, by the names the workers give them
    (debug/profiler.py: devharness-rank<R>-...pt.trace.json); ValueError when there is none."""
    found: dict[int, Path] = {}
    for f in sorted(Path(directory).glob("devharness-rank*.pt.trace.json"), key=lambda f: f.stat().st_mtime):
        rank = f.name[len("devharness-rank"):].split("-", 1)[0]
        if rank.isdigit():
            found[int(rank)] = f
    if not found:
        raise ValueError(f"--torch {directory}: no torch profile here (devharness-rank<R>-*.pt.trace.json, as "
                         "POST /debug/profile/start with kind torch writes them)")
    return {r: str(f) for r, f in sorted(found.items())}


def merge_torch(doc: dict, traces: dict[int, str]) -> int:
    """Put each rank's torch.profiler events (ops, user annotations such as `devharness step N`, kernels on a GPU)
    under that rank's process in `doc`, on its clock: a torch trace's times are `baseTimeNanoseconds` plus `ts`
    microseconds (unix time), moved by the rank's clock offset and shown from the document's t0. Each torch thread
    (a CPU thread, a GPU stream) becomes a track `torch <its name>`. How many events were merged."""
    other = doc["otherData"]
    t0, offsets = other["t0_unix_ns"], {int(r): o for r, o in other.get("clock_offsets_ns", {}).items()}
    events, meta, merged = doc["traceEvents"], [], 0
    for rank, path in traces.items():
        try:
            tdoc = json.loads(Path(path).read_text())
            base = int(tdoc.get("baseTimeNanoseconds", 0))
            tevents = tdoc["traceEvents"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a torch.profiler trace ({type(e).__name__}: {e})") from None
        shift_us = (base - offsets.get(rank, 0) - t0) / 1000
        tids: dict = {}
        names = {(ev.get("pid"), ev.get("tid")): ev.get("args", {}).get("name") for ev in tevents
                 if ev.get("ph") == "M" and ev.get("name") == "thread_name"}
        for ev in tevents:
            ph = ev.get("ph")
            if ph not in ("X", "i", "s", "f") or not isinstance(ev.get("ts"), (int, float)):
                continue
            key = (ev.get("pid"), ev.get("tid"))
            if key not in tids:
                tids[key] = TORCH_TID + len(tids)
                label = names.get(key) or f"thread {key[1]}"
                meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tids[key],
                             "args": {"name": f"torch {label}"}})
                meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tids[key],
                             "args": {"sort_index": tids[key]}})
            out = {k: v for k, v in ev.items() if k not in ("pid", "tid", "ts")}
            out.update(pid=rank, tid=tids[key], ts=round(ev["ts"] + shift_us, 3), cat=str(ev.get("cat", "torch")))
            if ph in ("s", "f"):
                out["id"] = (rank + 1) * TORCH_FLOW_ID + int(ev.get("id", 0))
            events.append(out)
            merged += 1
    body = [ev for ev in events if ev["ph"] != "M"]
    first = min(ev["ts"] for ev in body)
    if first < 0:   # the profile began before the window's first event: the axis starts with it
        for ev in body:
            ev["ts"] = round(ev["ts"] - first, 3)
        other["t0_unix_ns"] = t0 + int(first * 1000)
    body.sort(key=lambda ev: (ev["pid"], ev["tid"], ev["ts"], -ev.get("dur", 0)))
    doc["traceEvents"] = [ev for ev in events if ev["ph"] == "M"] + meta + body
    other["torch_events"] = merged
    return merged


def _flows(ops: dict[int, list[LedgerEntry]], us) -> list[dict]:
    """A flow arrow from each send (its start) to its receive (its end), matched by group and p2p sequence."""
    recvs = {(e.group, e.p2p_seq, e.peer, r): e for r, es in ops.items() for e in es if e.op == "recv"}
    out, flow_id = [], 0
    for rank, es in ops.items():
        for e in es:
            got = recvs.get((e.group, e.p2p_seq, rank, e.peer)) if e.op == "send" else None
            if got is None or not got.completed_ns:
                continue
            flow_id += 1
            tid = TRACKS["pipeline"]
            # The finish binds to the receive's slice (bp "e": the enclosing one): inside it, at its end.
            end = max(us(got.started_ns), us(got.completed_ns) - 0.001)
            out.append({"name": "activations", "cat": "pipeline", "ph": "s", "id": flow_id, "pid": rank, "tid": tid,
                        "ts": us(e.started_ns)})
            out.append({"name": "activations", "cat": "pipeline", "ph": "f", "bp": "e", "id": flow_id, "pid": e.peer,
                        "tid": tid, "ts": end})
    return out


def trace_main(args) -> int:
    if (args.bundle is None) == (args.url is None):
        raise ValueError("trace needs a BUNDLE directory or --url URL (one of them)")
    src = read_bundle(args.bundle) if args.bundle is not None else read_url(args.url, args.token)
    doc = write(src, args.out, args.steps, torch_traces_in(args.torch) if args.torch else None)
    out = Path(args.out)
    answers = doc["otherData"]["answers"]
    if args.json:
        print(json.dumps(answers))
    else:
        print(timeline.render(answers), end="")
        print(f"trace: wrote {len(doc['traceEvents'])} events to {out} (open it in ui.perfetto.dev)")
    return 0
