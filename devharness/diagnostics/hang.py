"""Who holds up a step, from the workers' published states alone (no worker has to answer).

A worker paused in a debugger stalls its peers inside a collective or a PP send/recv; the stalled
peers only show "collective, 30 s". This names the rank they wait for and why, so "rank 0 hangs"
becomes "rank 0 waits for rank 1 (paused at model.py:88)". The TUI reads it from a /debug snapshot
(`find_waits`, `root_blockers`); the executors put `hang_report`, read from the workers' state files,
into their hang errors. Both use the same rules. No torch here: the TUI imports this module.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import msgspec

from devharness.diagnostics.timeline import arrivals, collective_answers
from devharness.protocol.messages import Ledger, LedgerEntry, Snapshot, WorkerState

logger = logging.getLogger(__name__)

# Phases in which a worker can only make progress when some other rank does.
WAITING_PHASES = ("collective", "recv", "send")
# What a worker whose process the kernel has stopped (SIGSTOP, SIGTSTP) is shown doing: it runs no code, whatever
# it last published. Its detail says why, then what it was doing: "SIGSTOP, process state T; was in collective ...".
STOPPED = "stopped"
STOPPED_WHY = "SIGSTOP, process state T"


@dataclass(frozen=True)
class Blocker:
    rank: int
    why: str   # "paused at model.py:88", "dead", "in forward, layer 5 attention", "stopped (SIGSTOP, ...)"
    position: str = dataclasses.field(default="", compare=False)   # "tp 1, pp 0", where known

    @property
    def stopped(self) -> bool:
        return self.why.startswith(STOPPED + " (")

    def label(self) -> str:
        """ "rank 1 (paused at model.py:88)", "rank 1 (stopped: SIGSTOP, process state T)"."""
        return f"rank {self.rank} ({self.why[:-1].replace(' (', ': ', 1) if self.stopped else self.why})"

    def named(self) -> str:
        """ "rank 1 (tp 1, pp 0) is stopped (SIGSTOP, process state T)" for a stopped rank, else its label."""
        if self.stopped:
            return f"rank {self.rank}{f' ({self.position})' if self.position else ''} is {self.why}"
        return self.label()


def mark_stopped(st: WorkerState) -> WorkerState:
    """`st` as its process is: one the kernel has stopped (process state T, a local pid) shows phase "stopped", its
    last published phase in its detail. Its published state alone would say "idle", or "collective" beside its
    peer in the same all-reduce: a stopped rank would pass for a waiting one, and its peers would be blamed."""
    if not st.pid or not st.alive or st.phase in ("dead", STOPPED):
        return st
    from devharness.diagnostics.stacks import process_stopped   # py-spy's module; the TUI never calls this
    if not process_stopped(st.pid):
        return st
    was = st.phase + (f" {st.detail}" if st.detail else "")
    return msgspec.structs.replace(st, phase=STOPPED, detail=f"{STOPPED_WHY}; was in {was}, step {st.step}",
                                   waiting_for=None)


@dataclass(frozen=True)
class Wait:
    """`rank` has sat in `phase` for `waiting_s` and cannot go on until `blockers` do."""

    rank: int
    phase: str
    detail: str
    waiting_s: float
    blockers: tuple[Blocker, ...]
    told: str | None = None   # the worker's own account, when it reports a non-rank "waiting_for"

    def describe(self) -> str:
        if self.told is not None:
            return f"rank {self.rank} waits for {self.told}"
        them = ", ".join(b.label() for b in self.blockers)
        return f"rank {self.rank} waits for {them}"


def left_behind(w: WorkerState, by_rank: dict[int, WorkerState]) -> bool:
    """A rank shown in a collective whose listed peers have all gone on to later steps is not waiting
    for them: the collective completed, and the rank stopped before it could say it had left."""
    peers = [by_rank.get(r) for r in w.waiting_for] if isinstance(w.waiting_for, list) else []
    return bool(peers) and all(p is not None and p.step > w.step for p in peers)


def is_waiting(w: WorkerState, by_rank: dict[int, WorkerState]) -> bool:
    """Alive, not paused, and in a phase that only its peers can end."""
    return w.alive and w.paused is None and w.phase in WAITING_PHASES and not left_behind(w, by_rank)


def find_waits(workers: Snapshot | Iterable[WorkerState], now: float, threshold_s: float = 2.0) -> list[Wait]:
    """Every worker waiting (see is_waiting) for at least `threshold_s`, with the ranks it waits for.
    A worker whose peers are all in the same collective (or a matching send/recv) is slow, not blocked
    by anyone, and is left out."""
    workers = sorted(workers.workers if isinstance(workers, Snapshot) else workers, key=lambda w: w.rank)
    by_rank = {w.rank: w for w in workers}
    by_pos = {(w.pp_rank, w.tp_rank): w for w in workers}
    waits = []
    for w in workers:
        if not is_waiting(w, by_rank):
            continue
        waiting_s = now - w.phase_since if w.phase_since is not None else 0.0
        if waiting_s < threshold_s:
            continue
        if isinstance(w.waiting_for, str):
            waits.append(Wait(w.rank, w.phase, w.detail or "", waiting_s, (), told=w.waiting_for))
            continue
        if isinstance(w.waiting_for, list):
            blockers = tuple(_blocker(r, by_rank.get(r), w) for r in w.waiting_for)
        else:
            blockers = tuple(_blocker(p.rank, p, w) for p in _inferred_peers(w, workers, by_pos))
        if blockers:
            waits.append(Wait(w.rank, w.phase, w.detail or "", waiting_s, blockers))
    return waits


def root_blockers(waits: list[Wait]) -> list[Blocker]:
    """The blockers that are not themselves waiting: where a chain of waits ends (a paused or
    dead rank, usually), so a 4-rank hang reads as one cause, not four symptoms."""
    waiting = {w.rank for w in waits}
    roots: dict[int, Blocker] = {}
    for w in waits:
        for b in w.blockers:
            if b.rank not in waiting:
                roots.setdefault(b.rank, b)
    return [roots[r] for r in sorted(roots)]


def straggler_note(ledgers: dict[int, Ledger], hung: Iterable[int]) -> str:
    """ "rank 1 is not hung but the straggler: ..." when the ledgers' collectives name a straggler (diagnostics/
    timeline.py) that is not among the `hung` ranks: a rank consistently late is not the one a hang waits for, and
    its lateness is no symptom of the hang (collectives some rank never started are not counted); else ""."""
    _, s = collective_answers(arrivals(ledgers, None))
    if s is None or s["rank"] in set(hung):
        return ""
    where = f"layer {s['layer']} {s['site']}" if s["layer"] is not None else s["site"]
    return (f"rank {s['rank']} is not hung but the straggler: late at {where} ({s['group']}) by "
            f"{s['late_ms_p50']:.1f} ms (median of its recent collectives)")


def hang_report(run_id: str, world_size: int, step: int | None = None, now: float | None = None) -> str:
    """Who holds up `step`, from the workers' published states: the ranks that did not arrive
    (still computing, paused, stuck before the step) and the ranks waiting for them in a collective."""
    from devharness.debug.state import StateReader   # the state files; the TUI never reads them

    now = now if now is not None else time.time()
    states: dict[int, WorkerState | None] = {}
    for rank in range(world_size):
        reader = StateReader(run_id, rank)
        try:
            st = reader.state()
        finally:
            reader.close()
        states[rank] = None if st is None else mark_stopped(st)
    by_rank = {r: st for r, st in states.items() if st is not None}
    waiting, holding = [], []
    for rank, st in by_rank.items():
        who = f"rank {rank} (tp {st.tp_rank}, pp {st.pp_rank})"
        ago = "? s" if st.phase_since is None else f"{now - st.phase_since:.0f} s"
        where = f"{who} {st.phase}{' ' + st.detail if st.detail else ''} for {ago}"
        if st.phase == STOPPED:   # first: what it last published is not what it does
            why, _, was = (st.detail or "").partition("; ")
            holding.append(f"{who} is {STOPPED} ({why}){', ' + was if was else ''}")
        elif st.paused is not None:
            holding.append(f"{who} paused ({st.paused.reason}) at {st.paused.file}:{st.paused.line}")
        elif is_waiting(st, by_rank):
            waiting.append(where + (f", waiting for {st.waiting_for}" if st.waiting_for else ""))
        elif left_behind(st, by_rank):
            holding.append(f"{who} stuck in step {st.step}, last seen in {st.phase} {st.detail} {ago} ago, "
                           f"which its peers {st.waiting_for} finished")
        elif st.phase != "idle":
            holding.append(where)
        elif step is not None and st.step < step:
            holding.append(f"{who} never started step {step} (last finished step {st.step}, {ago} ago)")
    parts = []
    if holding:
        parts.append("did not arrive: " + "; ".join(holding))
    if waiting:
        parts.append("waiting: " + "; ".join(waiting))
    if unknown := [str(r) for r, st in states.items() if st is None]:
        parts.append(f"no state from rank(s) {', '.join(unknown)} (another node?)")
    return " | ".join(parts) if parts else "every rank is idle"


def _inferred_peers(w: WorkerState, workers: list[WorkerState],
                    by_pos: dict[tuple[int, int], WorkerState]) -> list[WorkerState]:
    """Without the worker's own `waiting_for`, infer its partners from the topology
    (rank = pp_rank * tp_size + tp_rank): a TP collective spans its PP stage; a PP recv
    comes from the previous stage's rank with the same tp_rank, a send goes to the next."""
    if w.phase == "collective":
        group = [p for p in workers if p.pp_rank == w.pp_rank and p.rank != w.rank]
        return [p for p in group if not _in_same_collective(p, w)]
    stage = w.pp_rank - 1 if w.phase == "recv" else w.pp_rank + 1
    partner = by_pos.get((stage, w.tp_rank))
    if partner is None:
        return []
    matching = "send" if w.phase == "recv" else "recv"
    if partner.alive and partner.phase == matching and partner.step == w.step:
        return []
    return [partner]


def _in_same_collective(p: WorkerState, w: WorkerState) -> bool:
    return (p.alive and p.paused is None and p.phase == "collective"
            and p.detail == w.detail and p.step == w.step)


def _blocker(rank: int, p: WorkerState | None, w: WorkerState) -> Blocker:
    return Blocker(rank, _why(p, w), "" if p is None else f"tp {p.tp_rank}, pp {p.pp_rank}")


def _why(p: WorkerState | None, w: WorkerState) -> str:
    if p is None:
        return "not reporting"
    if not p.alive or p.phase == "dead":
        return "dead"
    if p.phase == STOPPED:
        return f"{STOPPED} ({(p.detail or STOPPED_WHY).split('; ')[0]})"
    if p.paused is not None:
        verb = {"breakpoint": "paused", "exception": "stopped on exception"}.get(
            p.paused.reason, p.paused.reason.replace("_", " "))
        return f"{verb} at {p.paused.location}"
    where = f"in {p.phase}" + (f", {p.detail}" if p.detail else "")
    if p.step != w.step:
        where += f", step {p.step}"
    return where


@dataclass(frozen=True)
class HangEvent:
    """Ranks `waiting` have sat in `where` (a collective, its layer) since `since` for ranks `missing`,
    which are not in it; seen at `detected` (unix times). Named from the ledgers, it also says which `group`
    (its description: tp0, pp1), which sequence number `seq` and `op`. A `kind` "mismatch": the ranks of `group`
    made different ops at `seq` (`detail` names both sides); `missing` then holds the side that differs."""

    step: int
    waiting: tuple[int, ...]
    missing: tuple[Blocker, ...]
    where: str
    since: float
    detected: float
    group: str | None = None
    seq: int | None = None
    op: str | None = None
    kind: str = "hang"
    detail: str = ""
    straggler: str = ""   # straggler_note: a rank not hung that is consistently late

    def describe(self) -> str:
        if self.kind == "mismatch":
            return f"mismatch in group {self.group} at {self._seq_name()} {self.seq}: {self.detail}"
        ranks = ", ".join(map(str, self.waiting))
        at = f" (group {self.group}, {self._seq_name()} {self.seq}, {self.op})" if self.group is not None else ""
        waited = f"{self.detected - self.since:.1f} s in {self.where}{at}"
        note = f" ({self.straggler})" if self.straggler else ""
        if self.missing and all(b.stopped for b in self.missing):   # the cause first, then who waits for it
            them = "; ".join(b.named() for b in self.missing)
            return f"hang in step {self.step}: {them}; rank(s) {ranks} wait for it (for {waited}){note}"
        them = ", ".join(b.label() for b in self.missing)
        return f"hang in step {self.step}: rank(s) {ranks} have waited {waited} for {them}{note}"

    def _seq_name(self) -> str:
        return "p2p op" if self.op in ("send", "recv") else "collective"


def op_signature(e: LedgerEntry) -> tuple:
    if e.op in ("send", "recv"):   # a send pairs with a receive of the same shape and dtype
        return (tuple(e.in_shape), e.in_dtype)
    return (e.op, tuple(e.in_shape), e.in_dtype, tuple(e.out_shape), e.layer, e.site)


def ledger_events(ledgers: dict[int, Ledger], states: dict[int, WorkerState], now: float,
                  hang_after_s: float) -> list[HangEvent]:
    """What the ranks' collective ledgers say, group by group (collectives and p2p ops apart): the first sequence
    number at which the ranks made different ops (another op, shape, dtype or site: a mismatch, named at once),
    and an op that some ranks of the group started `hang_after_s` ago or more and the others never reached (a
    hang, naming them). Ledgers hold each rank's newest entries; only the sequence numbers they share are compared."""
    by_group: dict[tuple[str, bool], dict[int, dict[int, LedgerEntry]]] = {}
    members: dict[str, tuple[list[int], str]] = {}
    for rank, led in ledgers.items():
        for g in led.groups:
            members[g.name] = (sorted(g.ranks), g.desc)
        for e in led.entries:
            p2p = e.op in ("send", "recv")
            by_group.setdefault((e.group, p2p), {}).setdefault(rank, {})[e.seq] = e
    events = []
    for (group, p2p), per_rank in sorted(by_group.items()):
        ranks, desc = members[group]
        if any(r not in ledgers for r in ranks):
            continue   # a rank's ledger unread (another node, not started): nothing to compare it with
        seqs = {r: per_rank.get(r, {}) for r in ranks}
        lows = [min(s) for s in seqs.values() if s]
        highs = {r: max(s) if s else 0 for r, s in seqs.items()}
        low = max(lows) if lows else 0
        # Mismatch: the first shared sequence number whose ops differ.
        for seq in range(low, min(highs.values()) + 1):
            got = {r: seqs[r][seq] for r in ranks if seq in seqs[r]}
            if len(got) == len(ranks) and len({op_signature(e) for e in got.values()}) > 1:
                first = got[ranks[0]]
                odd = tuple(r for r, e in got.items() if op_signature(e) != op_signature(first)) or (ranks[-1],)
                events.append(HangEvent(
                    first.step, tuple(r for r in ranks if r not in odd),
                    tuple(Blocker(r, got[r].describe()) for r in odd), first.where(),
                    min(e.created_ns for e in got.values()) / 1e9, now, desc, seq, first.op, "mismatch",
                    ", ".join(f"rank {r} {e.describe()}" for r, e in got.items())))
                break
        else:
            # Hang: the first op some ranks have not reached, made by the others (on CUDA a host thread queues more
            # behind it) and not completed there for hang_after_s.
            top = max(highs.values())
            missing = [r for r in ranks if highs[r] < top]
            if not missing:
                continue
            seq = min(highs[r] for r in missing) + 1
            missing = [r for r in missing if highs[r] < seq]
            waiting = {r: seqs[r][seq] for r in ranks if seq in seqs[r]}
            if not waiting or any(e.state == "completed" for e in waiting.values()):
                continue
            since = min(e.started_ns or e.created_ns for e in waiting.values()) / 1e9
            if now - since < hang_after_s:
                continue
            first = next(iter(waiting.values()))
            events.append(HangEvent(first.step, tuple(waiting), tuple(_blocker(r, states.get(r), _as_state(first, r))
                                                                      for r in missing),
                                    first.where(), since, now, desc, seq, first.op))
    return events


def _as_state(e: LedgerEntry, rank: int) -> WorkerState:
    return WorkerState(rank=rank, step=e.step)


class HangDetector:
    """A driver thread that reads the workers' published states every `poll_s` (no worker has to answer,
    and the states are always on: it works without --debug). When some rank has waited in a collective
    for `hang_after_s` for a peer that is not in it, it reports one HangEvent per step: logged once and
    handed to `on_hang`. Never while a rank is paused in a debugger: that wait is the user's."""

    def __init__(self, run_id: str, world_size: int, hang_after_s: float,
                 on_hang: Callable[[HangEvent], None] | None = None, poll_s: float = 0.25):
        from devharness.debug.ledger import LedgerReader   # the workers' files; the TUI never reads them
        from devharness.debug.state import StateReader
        self.hang_after_s, self.poll_s, self.on_hang = hang_after_s, poll_s, on_hang
        self._readers = [StateReader(run_id, r) for r in range(world_size)]
        self._ledgers = [LedgerReader(run_id, r) for r in range(world_size)]
        self.events: list[HangEvent] = []
        self.current: HangEvent | None = None   # the last event, until the step it held up ends (or the workers fail)
        self._reported_steps: set[int] = set()
        self._reported: set[tuple] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devharness-hang-detector", daemon=True)

    def start(self) -> "HangDetector":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for r in (*self._readers, *self._ledgers):
            r.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:   # a state file mid-rewrite, a rank gone: look again at the next poll
                logger.debug("hang check failed", exc_info=True)

    def read_ledgers(self) -> dict[int, Ledger]:
        got = {}
        for r in self._ledgers:
            led = r.read(LEDGER_WINDOW)
            if led is not None:
                got[r.rank] = led
        return got

    def _states(self) -> list[WorkerState]:
        return [mark_stopped(s) for s in (r.state() for r in self._readers) if s is not None]

    def clear(self) -> None:
        """The workers failed or were replaced: whatever step the current event held up has ended with them."""
        with self._lock:
            self.current = None

    def _clear_if_over(self, states: list[WorkerState]) -> None:
        """The current event is over once every rank finished its step (it is idle in it, or in a later one)."""
        cur = self.current
        if cur is None or not states or not all(s.step > cur.step or s.step == cur.step and s.phase == "idle"
                                                for s in states):
            return
        with self._lock:
            if self.current is cur:
                self.current = None
        logger.warning("step %d went on: the hang is over", cur.step)

    def _report(self, event: HangEvent, key: tuple, ledgers: dict[int, Ledger] | None = None) -> HangEvent | None:
        with self._lock:
            if key in self._reported:
                return None
            self._reported.add(key)
        if event.kind == "hang" and ledgers:
            event = dataclasses.replace(event, straggler=straggler_note(ledgers, (b.rank for b in event.missing)))
        with self._lock:
            self._reported_steps.add(event.step)
            self.events.append(event)
            self.current = event
        logger.warning("%s", event.describe())
        if self.on_hang is not None:
            self.on_hang(event)
        return event

    def explain(self, now: float | None = None) -> HangEvent | None:
        """A mismatch the ledgers show now, whether or not a poll has seen it (a step just failed: was it this?)."""
        now = time.time() if now is None else now
        states = {s.rank: s for s in self._states()}
        for e in ledger_events(self.read_ledgers(), states, now, float("inf")):
            if e.kind == "mismatch":
                self._report(e, _key(e))
                return e
        return None

    def check(self, now: float | None = None) -> HangEvent | None:
        now = time.time() if now is None else now
        states = self._states()
        self._clear_if_over(states)
        if any(s.paused is not None for s in states):
            return None
        by_rank = {s.rank: s for s in states}
        stopped = [s for s in states if s.phase == STOPPED]
        # Every rank waiting now, however briefly: a stopped rank's hang names them all as waiting for it.
        waits_now = [w for w in find_waits(states, now, 0.0) if w.told is None]
        waits = [w for w in waits_now if w.waiting_s >= self.hang_after_s]
        # The ledgers first: they name the group, the sequence number and the op, and see a wait the waiting
        # rank's own thread does not know of (an async collective outstanding while its host thread moved on).
        # Of a step's hangs, one is reported: one whose missing ranks wait for no one (a PP stage waiting for
        # its TP peer, which waits for the rank at fault, is a symptom), first.
        ledgers = self.read_ledgers()
        events = ledger_events(ledgers, by_rank, now, self.hang_after_s)
        waiting = {r for e in events if e.kind == "hang" for r in e.waiting}
        events.sort(key=lambda e: e.kind == "hang" and any(b.rank in waiting for b in e.missing))
        found = None
        for e in events:
            if e.kind == "hang":
                if e.step in self._reported_steps:
                    continue
                e = _blame_stopped(e, stopped, waits_now)
            found = self._report(e, _key(e), ledgers) or found
        if found is not None:
            return found
        if not waits:
            return None
        first = max(waits, key=lambda w: w.waiting_s)
        step = by_rank[first.rank].step
        if step in self._reported_steps:
            return None
        event = HangEvent(step, tuple(w.rank for w in waits), tuple(root_blockers(waits)),
                          first.detail or first.phase, now - first.waiting_s, now)
        return self._report(_blame_stopped(event, stopped, waits_now), ("state", step), ledgers)


def _blame_stopped(e: HangEvent, stopped: list[WorkerState], waits: list[Wait]) -> HangEvent:
    """A hang while some rank's process is stopped: that rank holds it up, and every other rank involved waits
    for it, whatever the ledgers show. A rank stopped inside the same all-reduce as its peer looks arrived there;
    a rank stopped between steps leaves its TP peer waiting for it and the next stage waiting for that peer."""
    if not stopped:
        return e
    blamed = {s.rank for s in stopped}
    waiting = {*e.waiting, *(b.rank for b in e.missing), *(w.rank for w in waits)} - blamed
    return dataclasses.replace(e, waiting=tuple(sorted(waiting)),
                               missing=tuple(_blocker(s.rank, s, s) for s in stopped))


LEDGER_WINDOW = 512   # the newest entries of each rank the detector compares at each poll


def _key(e: HangEvent) -> tuple:
    """One report per mismatch (a group's first; a restarted set of workers starts anew: its first op's time
    differs) and per hung op."""
    return (e.kind, e.group, e.seq if e.kind == "hang" else None, e.step if e.kind == "hang" else e.since)
