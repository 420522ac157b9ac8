"""The hang view: from one snapshot, which ranks wait for whom.

A worker paused in a debugger stalls its peers inside a collective or a PP send/recv; the
stalled peers only show "collective, 30 s". This module names the rank they wait for and why,
so "rank 0 hangs" becomes "rank 0 waits for rank 1 (paused at model.py:88)".
"""
from __future__ import annotations

from dataclasses import dataclass

from devharness.tui.client import Snapshot, WorkerState

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


def find_waits(snapshot: Snapshot, now: float, threshold_s: float = 2.0) -> list[Wait]:
    """Every live worker stuck in a waiting phase for at least `threshold_s`, with the ranks it
    waits for. A worker whose peers are all in the same collective (or a matching send/recv)
    is slow, not blocked by anyone, and is left out."""
    by_rank = {w.rank: w for w in snapshot.workers}
    by_pos = {(w.pp_rank, w.tp_rank): w for w in snapshot.workers}
    waits = []
    for w in sorted(snapshot.workers, key=lambda w: w.rank):
        if not w.alive or w.paused is not None or w.phase not in WAITING_PHASES:
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
            blockers = tuple(Blocker(p.rank, _why(p, w)) for p in _inferred_peers(w, snapshot, by_pos))
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


def _inferred_peers(w: WorkerState, snapshot: Snapshot,
                    by_pos: dict[tuple[int, int], WorkerState]) -> list[WorkerState]:
    """Without the worker's own `waiting_for`, infer its partners from the topology
    (rank = pp_rank * tp_size + tp_rank): a TP collective spans its PP stage; a PP recv
    comes from the previous stage's rank with the same tp_rank, a send goes to the next."""
    if w.phase == "collective":
        group = [p for p in snapshot.workers if p.pp_rank == w.pp_rank and p.rank != w.rank]
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
    if p.step is not None and p.step != w.step:
        where += f", step {p.step}"
    return where
