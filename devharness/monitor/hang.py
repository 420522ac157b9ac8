"""Who holds up a step, from the workers' published states alone (no worker has to answer).

A worker paused in a debugger stalls its peers inside a collective or a PP send/recv; the stalled
peers only show "collective, 30 s". This names the rank they wait for and why, so "rank 0 hangs"
becomes "rank 0 waits for rank 1 (paused at model.py:88)". The TUI reads it from a /debug snapshot
(`find_waits`, `root_blockers`); the executors put `hang_report`, read from the workers' state files,
into their hang errors. Both use the same rules. No torch here: the TUI imports this module.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from devharness.protocol.messages import Snapshot, WorkerState

logger = logging.getLogger(__name__)

# Phases in which a worker can only make progress when some other rank does.
WAITING_PHASES = ("collective", "recv", "send")


@dataclass(frozen=True)
class Blocker:
    rank: int
    why: str   # "paused at model.py:88", "dead", "in forward, layer 5 attention", ...


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
        them = ", ".join(f"rank {b.rank} ({b.why})" for b in self.blockers)
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
            blockers = tuple(Blocker(r, _why(by_rank.get(r), w)) for r in w.waiting_for)
        else:
            blockers = tuple(Blocker(p.rank, _why(p, w)) for p in _inferred_peers(w, workers, by_pos))
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


def hang_report(run_id: str, world_size: int, step: int | None = None, now: float | None = None) -> str:
    """Who holds up `step`, from the workers' published states: the ranks that did not arrive
    (still computing, paused, stuck before the step) and the ranks waiting for them in a collective."""
    from devharness.debug.state import StateReader   # the state files; the TUI never reads them

    now = now if now is not None else time.time()
    states: dict[int, WorkerState | None] = {}
    for rank in range(world_size):
        reader = StateReader(run_id, rank)
        try:
            states[rank] = reader.state()
        finally:
            reader.close()
    by_rank = {r: st for r, st in states.items() if st is not None}
    waiting, holding = [], []
    for rank, st in by_rank.items():
        who = f"rank {rank} (tp {st.tp_rank}, pp {st.pp_rank})"
        ago = "? s" if st.phase_since is None else f"{now - st.phase_since:.0f} s"
        where = f"{who} {st.phase}{' ' + st.detail if st.detail else ''} for {ago}"
        if st.paused is not None:
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


def _why(p: WorkerState | None, w: WorkerState) -> str:
    if p is None:
        return "not reporting"
    if not p.alive or p.phase == "dead":
        return "dead"
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
    which are not in it; seen at `detected` (unix times)."""

    step: int
    waiting: tuple[int, ...]
    missing: tuple[Blocker, ...]
    where: str
    since: float
    detected: float

    def describe(self) -> str:
        them = ", ".join(f"rank {b.rank} ({b.why})" for b in self.missing)
        ranks = ", ".join(map(str, self.waiting))
        return (f"hang in step {self.step}: rank(s) {ranks} have waited {self.detected - self.since:.1f} s in "
                f"{self.where} for {them}")


class HangDetector:
    """A driver thread that reads the workers' published states every `poll_s` (no worker has to answer,
    and the states are always on: it works without --debug). When some rank has waited in a collective
    for `hang_after_s` for a peer that is not in it, it reports one HangEvent per step: logged once and
    handed to `on_hang`. Never while a rank is paused in a debugger: that wait is the user's."""

    def __init__(self, run_id: str, world_size: int, hang_after_s: float,
                 on_hang: Callable[[HangEvent], None] | None = None, poll_s: float = 0.25):
        from devharness.debug.state import StateReader   # the state files; the TUI never reads them
        self.hang_after_s, self.poll_s, self.on_hang = hang_after_s, poll_s, on_hang
        self._readers = [StateReader(run_id, r) for r in range(world_size)]
        self.events: list[HangEvent] = []
        self._reported_steps: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="devharness-hang-detector", daemon=True)

    def start(self) -> "HangDetector":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for r in self._readers:
            r.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:   # a state file mid-rewrite, a rank gone: look again at the next poll
                logger.debug("hang check failed", exc_info=True)

    def check(self, now: float | None = None) -> HangEvent | None:
        now = time.time() if now is None else now
        states = [s for s in (r.state() for r in self._readers) if s is not None]
        if any(s.paused is not None for s in states):
            return None
        waits = [w for w in find_waits(states, now, self.hang_after_s) if w.told is None]
        if not waits:
            return None
        by_rank = {s.rank: s for s in states}
        first = max(waits, key=lambda w: w.waiting_s)
        step = by_rank[first.rank].step
        if step in self._reported_steps:
            return None
        self._reported_steps.add(step)
        event = HangEvent(step, tuple(w.rank for w in waits), tuple(root_blockers(waits)),
                          first.detail or first.phase, now - first.waiting_s, now)
        self.events.append(event)
        logger.warning("%s", event.describe())
        if self.on_hang is not None:
            self.on_hang(event)
        return event
