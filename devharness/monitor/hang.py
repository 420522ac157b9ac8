"""Who holds up a step, from the workers' published states (no worker has to answer)."""
from __future__ import annotations

import time

from devharness.debug.state import StateReader


def hang_report(run_id: str, world_size: int, step: int | None = None, now: float | None = None) -> str:
    """Who holds up `step`, from the workers' published states: the ranks that did not arrive
    (still computing, paused, stuck before the step) and the ranks waiting for them in a collective."""
    now = now if now is not None else time.time()
    waiting, holding, unknown = [], [], []
    states = {}
    for rank in range(world_size):
        reader = StateReader(run_id, rank)
        try:
            states[rank] = reader.state()
        finally:
            reader.close()
    for rank, st in states.items():
        if st is None:
            unknown.append(str(rank))
            continue
        where = f"{st.phase}{' ' + st.detail if st.detail else ''} for {now - st.phase_since:.0f} s"
        if st.paused is not None:
            where = f"paused ({st.paused.reason}) at {st.paused.file}:{st.paused.line}"
        entry = f"rank {rank} (tp {st.tp_rank}, pp {st.pp_rank}) {where}"
        # A rank shown in a collective whose peers have all gone on to later steps is not waiting for
        # them: the collective completed, and the rank stopped before it could say it had left.
        peers = [states.get(p) for p in st.waiting_for or ()]
        left_behind = bool(peers) and all(p is not None and p.step > st.step for p in peers)
        if st.phase in ("collective", "recv", "send") and st.paused is None and not left_behind:
            waiting.append(entry + (f", waiting for {st.waiting_for}" if st.waiting_for else ""))
        elif left_behind and st.paused is None:
            holding.append(f"rank {rank} (tp {st.tp_rank}, pp {st.pp_rank}) stuck in step {st.step}, last seen in "
                           f"{st.phase} {st.detail} {now - st.phase_since:.0f} s ago, which its peers "
                           f"{st.waiting_for} finished")
        elif st.phase != "idle":
            holding.append(entry)
        elif step is not None and st.step < step:
            holding.append(f"rank {rank} (tp {st.tp_rank}, pp {st.pp_rank}) never started step {step} "
                           f"(last finished step {st.step}, {now - st.phase_since:.0f} s ago)")
    parts = []
    if holding:
        parts.append("did not arrive: " + "; ".join(holding))
    if waiting:
        parts.append("waiting: " + "; ".join(waiting))
    if unknown:
        parts.append(f"no state from rank(s) {', '.join(unknown)} (another node?)")
    return " | ".join(parts) if parts else "every rank is idle"
